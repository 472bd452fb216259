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
# The chat page's browser test drives Debian's chromium through chromium-driver (no browser is
# downloaded by pip); where they cannot be installed, that test is skipped.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  SUDO=none
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi
  if command -v apt-get >/dev/null && [ "$SUDO" != none ] \
     && { $SUDO apt-get update -qq >/dev/null 2>&1 || true; } \
     && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; then
    :
  else
    echo "setup.sh: chromium/chromedriver not installed: the chat page's browser test will be skipped"
  fi
fi
