"""llama.cpp loads what `kvcli convert` writes for qwen2 and qwen3, and continues a prompt as kvcli does.

    LLAMA_BIN=/path/to/llama.cpp/build/bin python3 benchmarks/qwen_vs_llama.py [--out DIR] [--outtype f32]

Builds tiny random Qwen2ForCausalLM, Qwen3ForCausalLM and a YaRN-scaled Qwen2 (transformers' own classes,
tests/tiny.py) with a small BPE vocabulary trained on Qwen2's pre-tokenizer, converts each with kvcli,
then runs the same greedy 16-token completion through `llama-completion` and `kvcli run` (both f32
weights, compute and cache; kvcli with its KV cache and with the hidden-state cache) and prints the texts
and whether they are equal. Exits 1 on any mismatch.
The weights are scaled up from transformers' 0.02 init so the next-token logits are far from ties, and
the output head's rows of the control and single-byte tokens are zeroed: a random model then writes whole
merged words (printable text to compare) rather than stray bytes and control tokens, which the two
programs print differently (llama.cpp writes a token's raw bytes, kvcli complete UTF-8 characters).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tiny import make_hf_qwen, qwen_tokenizer  # noqa: E402

from kvcli.convert import convert_hf  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog hello world qwen cache token key value rope head "
         "river stone light city early middle ages history begins").split()
VOCAB = 360  # a byte-level BPE of this size: 3 control tokens, 256 bytes, then 101 merges of the corpus
N_SINGLE = 3 + 256  # ids of the control and single-byte tokens (tokenizers' trainer puts them first)
PROMPT = "The history of the city begins in the early middle ages, when the quick brown fox"
# name -> make_hf_qwen kwargs. qwen2-yarn has qwen2's weights (one seed): only its RoPE differs, scaled from a
# 16-position original context that the 24-token prompt runs past.
MODELS = {
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen2-yarn": dict(arch="qwen2", rope_scaling={"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 16}, max_pos=64),
}


def corpus(n: int = 2000) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", ",", "!", " 42."])
            for _ in range(n)]


def build(name: str, out: Path, outtype: str) -> Path:
    model = make_hf_qwen(**MODELS[name], vocab=VOCAB, hidden=128, head_dim=32, n_layers=2, seed=1)
    with torch.no_grad():  # init std 0.02 -> 0.1 on the matrices: peaked logits, no near-ties at argmax
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(5.0)
        model.lm_head.weight[:N_SINGLE] = 0.0  # logit 0: some merged word's logit is above it
    d = out / name
    model.save_pretrained(d)
    qwen_tokenizer(d, VOCAB, corpus())
    return convert_hf(d, out / f"{name}.gguf", outtype=outtype, force=True, progress=False, log=lambda line: None)


def run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r.stdout


def llama_completion(cmd: list[str], tries: int = 5) -> str:
    """llama-completion's text. This build prints tokens through its asynchronous log and returns from main
    without flushing it: now and then the last tokens never reach stdout. A run counts once the blank line
    it logs after the generated text ("\\n\\n", completion.cpp) came out."""
    for _ in range(tries):
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
        if r.stdout.endswith("\n\n"):
            return r.stdout
    raise SystemExit(f"llama-completion's output was cut short {tries} times: {' '.join(cmd)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="directory for the checkpoints and GGUF files (default: a temporary one)")
    ap.add_argument("--outtype", default="f32", help="convert's --outtype")
    args = ap.parse_args()
    bin_dir = Path(os.environ.get("LLAMA_BIN", ""))
    if not (bin_dir / "llama-completion").exists():
        raise SystemExit("set LLAMA_BIN to llama.cpp's build/bin (llama-completion)")
    out = Path(args.out or tempfile.mkdtemp(prefix="qwen_vs_llama-"))
    out.mkdir(parents=True, exist_ok=True)
    common = ["-p", PROMPT, "-n", "16", "--temp", "0", "--ignore-eos", "-c", "64", "-t", "2", "-no-cnv",
              "--no-display-prompt"]
    kv = ["-ctk", "f32", "-ctv", "f32"]
    failed = 0
    for name in MODELS:
        path = build(name, out, args.outtype)
        theirs = llama_completion([str(bin_dir / "llama-completion"), "-m", str(path), *common, *kv, "-fa", "on",
                                   "--no-warmup"])
        kvcli = ["kvcli", "run", "-m", str(path), *common, "--dtype", "f32", "--weights", "f32"]
        ours = run([*kvcli, *kv]).strip()
        hidden = run([*kvcli, "--cache-mode", "hidden", "-cth", "f32"]).strip()
        theirs = theirs.strip()
        same = theirs == ours == hidden
        failed += not same
        print(f"{name}: {'EQUAL' if same else 'DIFFERENT'}\n  llama-completion:      {theirs!r}\n"
              f"  kvcli run:             {ours!r}\n  kvcli run (hidden):    {hidden!r}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
