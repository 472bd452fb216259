"""K-quant fixtures: one tiny random Llama quantized by llama.cpp's own llama-quantize.

    LLAMA_BIN=/path/to/llama.cpp/build/bin python tests/data/make_kquant_fixtures.py

The model: transformers' LlamaForCausalLM (tests/tiny.py), seed 15, hidden 256, ffn 256,
2 layers, 4 heads / 2 KV heads (head size 64), the 260-token byte vocab, untied head; every
matrix's rows are 256 long, so K-quants apply to each. It is written as an f32 GGUF
(a temporary file) and quantized to the types below; the .gguf files land next to this script.
No imatrix: llama-quantize takes IQ4_XS (and Q2_K) without one; it refuses only IQ1_*, IQ2_*,
IQ3_XXS and Q2_K_S files without one (src/llama-quant.cpp, tensor_requires_imatrix).

GGML types each file holds (gguf-py's reader; the 5 norms F32 in all; none holds Q8_0):
  tiny-Q4_K_M.gguf   Q4_K x 13 (token_embd included), Q6_K x 3 (output, blk.1 attn_v and ffn_down)
  tiny-Q5_K_M.gguf   Q5_K x 13, Q6_K x 3 (the same split)
  tiny-Q6_K.gguf     Q6_K x 16
  tiny-Q2_K.gguf     Q2_K x 9, Q3_K x 6 (attn_output, attn_v, ffn_down), Q6_K x 1 (output)
  tiny-IQ4_XS.gguf   IQ4_XS x 15, Q6_K x 1 (output)
Rerunning gives byte-identical files (llama-quantize on 1 thread).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, for tests.tiny

from tests.tiny import make_hf_model, write_gguf  # noqa: E402

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q2_K", "IQ4_XS")


def main() -> None:
    bin_dir = os.environ.get("LLAMA_BIN")
    if not bin_dir:
        sys.exit("set LLAMA_BIN to llama.cpp's build/bin (the folder holding llama-quantize)")
    quantize = Path(bin_dir) / "llama-quantize"
    model = make_hf_model(n_heads=4, n_kv_heads=2, tied=False, n_layers=2, hidden=256, seed=15, n_ff=256)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = write_gguf(model, Path(tmp) / "tiny-f32.gguf")
        for t in TYPES:
            out = HERE / f"tiny-{t}.gguf"
            subprocess.run([str(quantize), str(f32), str(out), t, "1"], check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL)
            print(f"{out.name}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
