#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks scripts
.venv/bin/ruff format --check src tests examples benchmarks scripts
.venv/bin/python -m pytest "$@"
