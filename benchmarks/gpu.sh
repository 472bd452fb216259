#!/usr/bin/env bash
# The prepared GPU check (issues 5-7, 15): one short run on a CUDA machine. Installs nothing: it needs
# the GPU machine's own torch and triton plus kvcli's pure-Python dependencies (gguf, typer, rich,
# sentencepiece, tokenizers, jinja2; carry them as wheels where absent, see the device tool's notes).
# The real model file cannot travel there (98 MB), so the default model's rows use its published
# shape with random weights (`--shape smollm2-135m`, labelled synthetic): the same speed, no text.
#   bash benchmarks/gpu.sh [quick]      # quick: fewer depths and repetitions
#   bash benchmarks/gpu.sh weights      # only section 4, the resident weight forms (issue 15)
#   bash benchmarks/gpu.sh dry          # section 4's pieces on CPU, tiny, Triton interpreted: checks the plumbing
# Sections 2-3 keep --weights f16 (dense weights, as before the CUDA weight forms), so their figures stay
# comparable; section 4 sets native (4-bit blocks, the Triton GEMV) beside f16.
set -euo pipefail
cd "$(dirname "$0")/.."
# kvcli is not installed there: lay the import tree the distribution installs (convert/ as
# kvcli.convert) out of symlinks, and put it on the path. gguf-py is not in that machine's image:
# where .whl/ holds its wheel (carried), it is installed to /tmp/site first.
STAGE=$(mktemp -d); mkdir "$STAGE/kvcli"
for f in "$PWD"/kvcli/*; do ln -s "$f" "$STAGE/kvcli/"; done
ln -s "$PWD/convert" "$STAGE/kvcli/convert"
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  STAGE="$STAGE:/tmp/site"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
MODE=${1:-full}
case "$MODE" in full|quick|weights|dry) ;; *) echo "usage: bash benchmarks/gpu.sh [quick|weights|dry]" >&2; exit 2;; esac
R=3; DEPTHS=0,4096,32768; BIG=4096,32768; DEVICE=cuda
if [ "$MODE" = quick ]; then R=1; DEPTHS=0,4096; BIG=4096; fi
if [ "$MODE" = dry ]; then R=1; DEVICE=cpu; else
  python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
fi
bench() { python3 -m kvcli.cli bench --device "$DEVICE" -r "$R" "$@"; }

if [ "$MODE" = full ] || [ "$MODE" = quick ]; then
echo "== 1. Triton kernels against their PyTorch references on the GPU, and attention bandwidth"
python3 benchmarks/gpu_kernels.py --depths 4096 32768 --types f16 q8_0 q4_0 q4_hadamard tq4 tq3 tq2 \
  --window-types q8_0 q4_hadamard tq3

echo "== 2. SmolLM2-135M shape (GQA 9/3): pp512 / tg128 at depths $DEPTHS"
for t in f16 q8_0 q4_0 q4_hadamard tq4 tq3 tq2; do
  bench --shape smollm2-135m --weights f16 -p 512 -n 128 -d "$DEPTHS" -ctk "$t" -ctv "$t"
done
# the recent window read by the attention kernel (issue 16.3): 16 positions (the rows above have none)
for t in q8_0 tq3; do
  bench --shape smollm2-135m --weights f16 -p 512 -n 128 -d "$DEPTHS" -ctk "$t" -ctv "$t" -cw 16
done
bench --shape smollm2-135m --weights f16 -p 512 -n 128 -d "$DEPTHS" --cache-mode hidden -cth f16

echo "== 3. llama2-7b shape (MHA): tg128 at depths $BIG; Triton on, then off (PyTorch reference on CUDA)"
for t in f16 q8_0 q4_0 q4_hadamard tq4 tq3; do
  bench --shape llama2-7b --weights f16 -p 0 -n 128 -d "$BIG" -ctk "$t" -ctv "$t"
  KVCLI_TRITON=0 bench --shape llama2-7b --weights f16 -p 0 -n 32 -d "$BIG" -ctk "$t" -ctv "$t" | sed 's/| CUDA |/| CUDA, Triton off |/'
done
bench --shape llama2-7b --weights f16 -p 0 -n 128 -d "$BIG" --cache-mode hidden -cth f16,q4_hadamard
echo "targets: q4_hadamard tg >= 2x f16 tg at d32768 on llama2-7b; attention kernel >= 70% of peak bandwidth (section 1)"
fi

echo "== 4. resident weight forms on CUDA: native (4-bit blocks, the Triton GEMV) beside f16 weights"
if [ "$MODE" = dry ]; then
  python3 benchmarks/gpu_weights.py --dry
  SHAPES=smollm2-135m; N=4; BIG=0,16
else
  python3 benchmarks/gpu_weights.py
  SHAPES="llama2-7b smollm2-135m"; N=128
fi
for s in $SHAPES; do
  for w in native f16; do
    bench --shape "$s" --weights "$w" -p 0 -n "$N" -d "$BIG" | sed "s/| \(CUDA\|CPU\) |/| \1, weights $w |/"
  done
done
echo "targets: llama2-7b tg with native weights above f16's at d4096 (int4 blocks: 5 bits a weight, 3.2x fewer bytes to read)"
