"""Which components make the tq types (kvcli/cache/turbo.py): KLD against f16 of format variants.

    python benchmarks/turbo_components.py [--chunks 5] [-c 512] [--json out.json] VARIANT...

A VARIANT names a TurboStore built for this run (registered here only, never in kvcli) as
dash-separated parts, defaults in brackets:
    b4 | b3 | b2            bits per code (required)
    blk64 | blk32           elements per scale block [blk64]
    uni | tread | lm |      codebook: uniform mid-rise grid, q4_0's mid-tread grid u - 2^(b-1) with
    lmdata | g              a signed scale (q4_hadamard's rule), Lloyd-Max for N(0, 1), Lloyd-Max
                            fitted to this model's rotated, block-RMS-normalised K/V (text from
                            past the scored chunks of the file), or (3 bits) +-{0.5, 1.5, 2.5, 4.5},
                            Lloyd-Max's shape on the 4-bit grid the int4 GEMM reads [uni]
    mse | mse1 | rms | norm scale rule: least-squares search over kvcli's grid, one candidate
                            (g = 1) refit, d = block RMS times the codebook's Gaussian-optimal
                            scale, or TurboQuant's norm correction (codes as rms, then d with
                            |d L[u]| = |y|) [mse]
    okv | ok | o0           per-head mean offset on keys and values, keys only, none [okv]
    s4 | s0                 f16 sink positions [s4]
    rot | norot             Hadamard rotation or none [rot]
A K/V pair is written KVARIANT/VVARIANT, e.g. b3/b2-blk32, a recent window VARIANT@N, e.g. b3-lm@16.
Registered types (tq4, q4_hadamard, ...) may be given
as they are. Each run is `kvcli perplexity -f FILE -c C --chunks N --sweep VARIANTS` in this
process; the table is that command's.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from kvcli.cache import STORAGE_TYPES
from kvcli.cache.turbo import TurboStore, lloyd_max_levels, uniform_levels

WIKI = "/work/shared/data/wikitext-2-raw/wiki.test.raw"
_DATA_CODEBOOKS: dict[int, tuple[float, ...]] = {}


def gaussian_scale(levels: tuple[float, ...]) -> float:
    """c minimising E (x - c L[nearest(x / c)])^2 for x ~ N(0, 1) (a fine grid search on samples)."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    lv = torch.tensor(levels)
    mid = (lv[1:] + lv[:-1]) / 2
    best = (math.inf, 1.0)
    for c in torch.linspace(0.05, 2.0, 391).tolist():
        err = ((x - c * lv[torch.bucketize(x / c, mid)]) ** 2).mean().item()
        best = min(best, (err, c))
    return best[1]


def lloyd(samples: torch.Tensor, levels: tuple[float, ...], iters: int = 60) -> tuple[float, ...]:
    """1-D Lloyd (k-means) on samples from the given start levels."""
    lv = torch.tensor(levels, dtype=torch.float64)
    x = samples.double()
    for _ in range(iters):
        u = torch.bucketize(x, (lv[1:] + lv[:-1]) / 2)
        lv = torch.stack([x[u == i].mean() if (u == i).any() else lv[i] for i in range(len(lv))]).sort().values
    return tuple(lv.tolist())


def data_codebook(bits: int) -> tuple[float, ...]:
    """Lloyd-Max levels for this model's rotated, offset K and V, each 64-block divided by its RMS:
    captured from two 512-token chunks of text past the first 20 scored ones."""
    if bits in _DATA_CODEBOOKS:
        return _DATA_CODEBOOKS[bits]
    from kvcli.llama import Llama
    from kvcli.pull import pull_default

    seen: list[torch.Tensor] = []

    class Capture(TurboStore):
        name, bits, block_size, block_bytes, levels = "capture_tq", 4, 64, 34, uniform_levels(4)

        def quantize(self, y):
            blocks = y.reshape(-1, 64)
            seen.append((blocks / blocks.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)).flatten())
            return super().quantize(y)

    try:
        llm = Llama(pull_default(), ctx_size=512, dtype="f32", cache_type_k="capture_tq", cache_type_v="capture_tq")
        text = open(WIKI, encoding="utf-8").read()
        ids = llm.tokenize(text[len(text) // 2 : len(text) // 2 + 20000])[:1024]
        for i in range(0, 1024, 512):
            llm.logits(ids[i : i + 512])
    finally:
        STORAGE_TYPES.pop("capture_tq", None)
    samples = torch.cat(seen)
    samples = samples[torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))[: 1 << 21]]
    _DATA_CODEBOOKS[bits] = lloyd(samples, lloyd_max_levels(bits))
    print(f"data codebook, {bits} bits: {[round(v, 4) for v in _DATA_CODEBOOKS[bits]]}", file=sys.stderr)
    return _DATA_CODEBOOKS[bits]


def grid_levels(bits: int) -> tuple[float, ...]:
    if bits != 3:
        raise SystemExit("the g codebook is a 3-bit one")
    return (-4.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 4.5)


def variant(name: str) -> str:
    """Register the TurboStore a VARIANT names (once) and return its registry name."""
    if name in STORAGE_TYPES:
        return name
    parts = name.split("-")
    opts = dict(bits=None, block=64, book="uni", rule="mse", off="okv", sink=4, rot=True)
    for p in parts:
        if p in ("b2", "b3", "b4"):
            opts["bits"] = int(p[1])
        elif p in ("blk32", "blk64"):
            opts["block"] = int(p[3:])
        elif p in ("uni", "tread", "lm", "lmdata", "g"):
            opts["book"] = p
        elif p in ("mse", "mse1", "rms", "norm"):
            opts["rule"] = p
        elif p in ("okv", "ok", "o0"):
            opts["off"] = p
        elif p in ("s4", "s0"):
            opts["sink"] = int(p[1])
        elif p in ("rot", "norot"):
            opts["rot"] = p == "rot"
        else:
            raise SystemExit(f"unknown variant part {p!r} in {name!r}")
    if opts["bits"] is None:
        raise SystemExit(f"{name!r}: give the bits (b2, b3, b4)")
    b, bs = opts["bits"], opts["block"]
    levels = {"uni": uniform_levels, "tread": lambda b: uniform_levels(b, tread=True), "lm": lloyd_max_levels,
              "lmdata": data_codebook, "g": grid_levels}[opts["book"]](b)
    rule, c = opts["rule"], gaussian_scale(levels)
    attrs = dict(name=name, bits=b, block_size=bs, block_bytes=b * bs // 8 + 2, levels=levels, signed=opts["book"] == "tread",
                 n_sink=opts["sink"], offset_keys=opts["off"] != "o0", offset_values=opts["off"] == "okv")

    def quantize(self, y):
        B, T, H, D = y.shape
        blocks = y.reshape(B, T, H, D // bs, bs)
        if rule in ("mse", "mse1"):
            return TurboStore.quantize(self, y)
        rms = blocks.pow(2).mean(-1, keepdim=True).sqrt()
        d = rms * c
        lv = self.lv
        u = torch.bucketize(blocks / torch.where(d == 0, 1.0, d), (lv[1:] + lv[:-1]) / 2)
        if rule == "norm":  # |d L[u]| = |y|
            d = blocks.norm(dim=-1, keepdim=True) / lv[u].norm(dim=-1, keepdim=True).clamp_min(1e-30)
        return u.to(torch.uint8).view(B, T, H, D), d.bfloat16().float().view(B, T, H, -1)

    def init(self, *args, **kwargs):
        TurboStore.__init__(self, *args, **kwargs)
        if rule == "mse1":
            self.steps = 1 / self.lv.abs().max().view(1)
        if not opts["rot"]:
            self.rot = torch.eye(self.head_dim, device=self.device)

    attrs.update(quantize=quantize, __init__=init)
    type(f"Variant_{len(STORAGE_TYPES)}", (TurboStore,), attrs)
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("-f", "--file", default=WIKI)
    ap.add_argument("--json", default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    sweep = ",".join("/".join(variant(side) for side in v.partition("@")[0].split("/")) + "".join(v.partition("@")[1:])
                     for v in a.variants)  # a recent window as the sweep takes it: VARIANT@N
    from kvcli.cli import app

    args = ["perplexity", "-f", a.file, "-c", str(a.ctx), "--chunks", str(a.chunks), "--sweep", sweep]
    args += ["--json", a.json] if a.json else []
    args += ["-t", str(a.threads)] if a.threads else []
    app(args, standalone_mode=False)


if __name__ == "__main__":
    main()
