#!/usr/bin/env bash
# Peak RSS of `kvcli perplexity` (plain, --kl-divergence-base write and read, --sweep) beside
# llama-perplexity's, on the same text and chunks (issue 15, point 4). Prints one line a run.
# usage: LLAMA_BIN=/path/to/llama.cpp/build/bin benchmarks/perplexity_rss.sh TEXT [model.gguf] [chunks]
# Each run's stdout and stderr stay in $OUT (default: a temporary folder) for diffing two builds.
set -euo pipefail
TEXT=${1:?give the text, e.g. wikitext-2-raw/wiki.test.raw}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CHUNKS=${3:-20}
LP=${LLAMA_BIN:?set LLAMA_BIN to llama.cpp build/bin}/llama-perplexity
OUT=${OUT:-$(mktemp -d)}
COMMON=(-m "$MODEL" -f "$TEXT" -c 512 --chunks "$CHUNKS" -t 1)
measure() {  # name command...: peak RSS (MB) and wall time
  local name=$1; shift
  /usr/bin/time -v "$@" >"$OUT/$name.out" 2>"$OUT/$name.err" </dev/null
  awk -v n="$name" '/Maximum resident/ {rss = $6 / 1024} /Elapsed/ {t = $8}
                    END {printf "%-20s %7.0f MB  %s\n", n, rss, t}' "$OUT/$name.err"
}
measure kvcli-plain kvcli perplexity "${COMMON[@]}"
measure kvcli-base-write kvcli perplexity "${COMMON[@]}" --kl-divergence-base "$OUT/kvcli.kld"
measure kvcli-base-read kvcli perplexity "${COMMON[@]}" --kl-divergence-base "$OUT/kvcli.kld" --kl-divergence \
  -ctk q8_0 -ctv q8_0
measure kvcli-sweep kvcli perplexity "${COMMON[@]}" --sweep q8_0/q8_0
measure llama-plain "$LP" "${COMMON[@]}"
measure llama-base-write "$LP" "${COMMON[@]}" --kl-divergence-base "$OUT/llama.kld"
measure llama-base-read "$LP" "${COMMON[@]}" --kl-divergence-base "$OUT/llama.kld" --kl-divergence \
  -ctk q8_0 -ctv q8_0 -fa on
rm -f "$OUT/kvcli.kld" "$OUT/llama.kld"
echo "outputs in $OUT"
