#!/usr/bin/env bash
# Create .venv (Python 3.11) and install gossamer with its dev tools; a no-op when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v WARNING || true
  # torch is pinned to 2.13.0; the machines' local wheel is the CPU build.
  .venv/bin/python -m pip install --quiet -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import gossamer, torch; print('gossamer', gossamer.__version__, 'torch', torch.__version__)"
  # Compile the compressors' CPU kernels once (numba caches them beside the source), so that
  # the first job does not compile them in each of its ranks at once.
  .venv/bin/python -c "
import torch
from gossamer.compression import get_compressor
x = torch.randn(600_000)
for spec in ('uint8', 'qsgd:16', 'natural', 'natural_dithering:8', 'topk:0.01', 'stc:0.01', 'sign'):
    c = get_compressor(spec)
    c.decompress_add_(c.compress(x), x.clone())
"
  rm -f .venv/.installed-* && touch "$stamp"
fi
