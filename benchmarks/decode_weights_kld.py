"""Decode-path accuracy of the resident weight forms: KL divergence of token-by-token logits,
--weights native against --weights f32, on the same text (issue 15).

`kvcli perplexity` scores whole chunks, and a batch above UPCAST_ROWS rows runs as an f32 GEMM
over dequantized weights, so there native differs from f32 only by bf16 scales. Generation
multiplies one row at a time through torch's int4/int8 weight-only kernels (bf16 activations);
this feeds a text one token at a time to both and reports what that path costs.

    python benchmarks/decode_weights_kld.py [-m MODEL] [-f wiki.test.raw] [-n 256] [-t 1]
"""

from __future__ import annotations

import argparse

import torch

from kvcli import Llama
from kvcli.llama import DEFAULT


def decode_logprobs(llm: Llama, ids: list[int]) -> torch.Tensor:
    """(n, vocab) f32 log-probs after each token, fed one at a time."""
    rows = []
    for pos, t in enumerate(ids):
        logits = llm.model(torch.tensor([[t]]), llm.cache, pos, last_only=True)
        rows.append(torch.log_softmax(logits[0, -1].float(), -1))
    return torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-f", "--file", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    ap.add_argument("-n", type=int, default=256, help="tokens fed")
    ap.add_argument("-t", "--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    text = open(a.file, encoding="utf-8").read()[:20000]
    lp = {}
    for w in ("f32", "native"):
        llm = Llama(a.model or DEFAULT, ctx_size=a.n, weights=w, dtype="f32", threads=a.threads)
        ids = llm.tokenize(text)[: a.n]
        lp[w] = decode_logprobs(llm, ids)
    kl = (lp["f32"].exp() * (lp["f32"] - lp["native"])).sum(-1)
    same = (lp["f32"].argmax(-1) == lp["native"].argmax(-1)).float().mean()
    print(f"{a.n} tokens fed one at a time, native vs f32 weights: mean KLD {kl.mean():.6f}, "
          f"99% {kl.quantile(0.99):.6f}, max {kl.max():.6f}, same top {100 * same:.2f}%")


if __name__ == "__main__":
    main()
