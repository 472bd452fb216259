#!/usr/bin/env bash
# Decode speed (tg64, f16 cache) with one core busy, kvcli beside llama.cpp (issue 14, point 8).
# usage: LLAMA_BIN=/path/to/llama.cpp/build/bin benchmarks/busy_cpu.sh [model.gguf] [kvcli flags...]
# A spinning process pinned to the last core stands for "another program"; each tool runs at its
# default thread count and at -t 1, quiet then busy.
set -euo pipefail
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
shift || true
LB=${LLAMA_BIN:?set LLAMA_BIN to llama.cpp build/bin}/llama-bench
LAST=$(( $(nproc) - 1 ))
kv() {  # prints: kvcli threads=N t/s
  kvcli bench -m "$MODEL" -p 0 -n 64 -r 3 -o csv "$@" 2>/dev/null | grep tg64 |
    awk -F, '{printf "kvcli      threads=%s %8.2f t/s\n", $4, $12}'
}
llama() {
  "$LB" -m "$MODEL" -p 0 -n 64 -r 3 -fa 1 "$@" </dev/null 2>/dev/null | grep tg64 |
    awk -F'|' '{gsub(/ /, "", $6); gsub(/ /, "", $9); printf "llama.cpp  threads=%s %s t/s\n", $6, $9}'
}
for state in quiet busy; do
  if [ "$state" = busy ]; then taskset -c "$LAST" python3 -c "while True: pass" & SPIN=$!; sleep 1; fi
  echo "== $state"
  kv "$@"; kv -t 1 "$@"; llama; llama -t 1
  if [ "$state" = busy ]; then kill "$SPIN"; fi
done
