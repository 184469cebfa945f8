#!/usr/bin/env bash
# Set up (if needed) and run the main demo on 4 local ranks. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gossamer run -np "${NP:-4}" examples/train_digits.py "$@"
