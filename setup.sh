#!/usr/bin/env bash
# Set up a fresh machine for kvcli: torch (only where none is installed), then kvcli with its test extra.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # The CPU build of 2.13.0 lies on this disk; a bare `torch` would pull a multi-GB CUDA build.
  # Where a torch is already installed (e.g. the GPU machine's CUDA build), it is left alone.
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e '.[test]'
