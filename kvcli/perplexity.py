"""`kvcli perplexity`: llama-perplexity's method and output, KL divergence against a base, a cache sweep.

The method is llama.cpp's (tools/perplexity/perplexity.cpp, `perplexity()`):
tokenize the whole text (BOS as the vocab says), cut it into n_chunk = n_tokens // n_ctx chunks of
n_ctx tokens, set the first token of each chunk to BOS where the vocab adds one, and score the
positions first = n_ctx // 2 .. n_ctx - 2 of each chunk (each predicts the next, original token):
n_ctx - 1 - n_ctx // 2 tokens per chunk (255 at -c 512). PPL = exp(mean NLL); the error is
llama.cpp's ppl * sqrt((<nll^2> - <nll>^2) / (count - 1)).

KL-divergence base file (`--kl-divergence-base FILE`), little-endian, version 2:

    8 bytes   magic b"KVCLIKLD"
    u32       header length H, then H bytes of UTF-8 JSON: version, model, n_vocab, n_ctx, n_chunk,
              first, n_scored, bos_id (the id put at position 0 of each chunk, or null), dtype,
              cache_type_k, cache_type_v
    i32       tokens[n_chunk * n_ctx]  (as tokenized, before any BOS substitution)
    records   n_chunk * n_scored of {f32 nll, f32 scale, f32 min_log_prob, u16 q[n_vocab]}, chunk-major

Each record is one scored position's full log-softmax, quantized as llama.cpp's logits file does:
log p_i = scale * q_i + min_log_prob over the top 16 nats, q = 0 below (those are ignored by the
KLD, as in llama.cpp). About 2 bytes per vocab entry: 20 chunks x 255 x 49152 -> 501 MB.
Unlike llama.cpp's file, each record also keeps the target token's exact NLL, so that
"Mean PPL(base)" equals the base run's PPL (llama.cpp reads it from the clipped 16-bit values,
which understates rare targets' NLL: -0.2% on 4 chunks of WikiText-2 with SmolLM2).
"""

from __future__ import annotations

import json
import os
import math
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import typer

from kvcli.errors import KvcliError

if TYPE_CHECKING:  # torch and numpy are imported lazily so that `kvcli --help` stays instant
    import numpy as np
    import torch

KLD_MAGIC = b"KVCLIKLD"
KLD_VERSION = 2
LOG_PROB_FLOOR = 16.0  # nats below the top log-prob that the base keeps (llama.cpp's `max_logit - 16`)
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# The method: chunks, scored positions, NLL, PPL and its error
# ---------------------------------------------------------------------------------------------

def first_scored(n_ctx: int) -> int:
    return n_ctx // 2


def n_scored(n_ctx: int) -> int:
    """Scored tokens per chunk: positions n_ctx//2 .. n_ctx-2 predict tokens n_ctx//2+1 .. n_ctx-1."""
    return n_ctx - 1 - n_ctx // 2


def make_chunks(tokens: list[int], n_ctx: int, n_chunks: int = -1, bos_id: int | None = None):
    """-> (inputs (n_chunk, n_ctx), targets (n_chunk, n_scored)) LongTensors.

    inputs have BOS at position 0 where `bos_id` is given (the vocab adds BOS); targets are the
    original tokens after each scored position.
    """
    import torch

    if n_scored(n_ctx) < 1:
        raise KvcliError(f"-c {n_ctx} scores no tokens; use a larger -c")
    if len(tokens) < 2 * n_ctx:
        raise KvcliError(f"perplexity needs at least 2*n_ctx = {2 * n_ctx} tokens, got {len(tokens)}; "
                         f"give a longer file or a smaller -c")
    if n_chunks == 0 or n_chunks < -1:
        raise KvcliError(f"--chunks must be -1 (all) or positive, got {n_chunks}")
    n_max = len(tokens) // n_ctx
    n_chunk = n_max if n_chunks < 0 else min(n_chunks, n_max)
    x = torch.tensor(tokens[: n_chunk * n_ctx], dtype=torch.long).view(n_chunk, n_ctx)
    targets = x[:, first_scored(n_ctx) + 1 :].clone()
    inputs = x.clone()
    if bos_id is not None:
        inputs[:, 0] = bos_id
    return inputs, targets


def scored_log_probs(logits: "torch.Tensor", n_ctx: int) -> "torch.Tensor":
    """logits (..., n_ctx, V) -> f32 log-softmax at the scored positions (..., n_scored, V)."""
    import torch

    return torch.log_softmax(logits[..., first_scored(n_ctx) : n_ctx - 1, :].float(), dim=-1)


def token_nll(log_probs: "torch.Tensor", targets: "torch.Tensor") -> "torch.Tensor":
    """(..., S, V), (..., S) -> f64 negative log-likelihood of each target (..., S)."""
    return -log_probs.gather(-1, targets[..., None])[..., 0].double()


def ppl_and_error(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    """llama.cpp's `Final estimate`: PPL = exp(<nll>), error = PPL * sqrt(var(nll) / (count - 1)).

    The error is NaN where llama.cpp reports a negative variance (or a single token)."""
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    if var <= 0 or count < 2:
        return ppl, float("nan")
    return ppl, ppl * math.sqrt(var / (count - 1))


@dataclass
class PplStats:
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nll: "torch.Tensor") -> None:
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += nll.numel()

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def estimate(self) -> tuple[float, float]:
        return ppl_and_error(self.nll, self.nll2, self.count)


# ---------------------------------------------------------------------------------------------
# Base log-probs: llama.cpp's 16-bit quantization, and the KL-divergence statistics
# ---------------------------------------------------------------------------------------------

def quantize_log_probs(log_probs: "torch.Tensor"):
    """(N, V) f32 log-softmax -> (scale (N,) f32, min_log_prob (N,) f32, q (N, V) int32 in 0..65535).

    llama.cpp's `log_softmax(..., uint16_t *)`: keep the top 16 nats, 65535 steps, round half even."""
    import torch

    top = log_probs.max(dim=-1).values
    low = torch.maximum(log_probs.min(dim=-1).values, top - LOG_PROB_FLOOR)
    scale = (top - low) / 65535.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((log_probs - low[:, None]) * inv[:, None])
    q = torch.where(log_probs > low[:, None], q, torch.zeros_like(q)).clamp_(0, 65535).to(torch.int32)
    return scale, low, q


def dequantize_log_probs(scale: "torch.Tensor", min_log_prob: "torch.Tensor", q: "torch.Tensor") -> "torch.Tensor":
    return scale[:, None] * q.float() + min_log_prob[:, None]


def kld_terms(log_q: "torch.Tensor", log_base: "torch.Tensor", targets: "torch.Tensor",
              nll_base: "torch.Tensor | None" = None) -> dict:
    """Per-token terms of llama.cpp's `kl_divergence` for S positions: log_q, log_base (S, V), targets (S,).

    KLD = sum_i p_base,i (log p_base,i - log q_i) over entries with log p_base,i > -16.
    nll_base: the base's exact target NLL (S,) where log_base is a rounded copy."""
    import torch

    nll = token_nll(log_q, targets)
    nll_base = token_nll(log_base, targets) if nll_base is None else nll_base.double()
    keep = log_base > -LOG_PROB_FLOOR
    p_base = torch.where(keep, log_base.exp(), torch.zeros_like(log_base))
    kld = (p_base * torch.where(keep, log_base - log_q, torch.zeros_like(log_q))).double().sum(-1)
    same_top = log_q.argmax(-1) == log_base.argmax(-1)
    p_diff = torch.exp(-nll) - torch.exp(-nll_base)
    return dict(nll=nll, nll_base=nll_base, kld=kld, same_top=same_top, p_diff=p_diff)


def mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def percentile(sorted_values: "np.ndarray", fraction: float) -> float:
    """llama.cpp's linear interpolation between the two nearest ranks."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * sorted_values[ip] + p * sorted_values[min(ip + 1, len(sorted_values) - 1)])


def median(sorted_values: "np.ndarray") -> float:
    n = len(sorted_values)
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


def _safe_div(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class KldStats:
    """The sums of llama.cpp's `kl_divergence_result` plus every token's KLD and Δp (for percentiles)."""

    nll: float = 0.0
    nll2: float = 0.0
    nll_base: float = 0.0
    nll_base2: float = 0.0
    nll_nll_base: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    p_diff: float = 0.0
    p_diff2: float = 0.0
    p_diff4: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list = field(default_factory=list)
    p_diff_values: list = field(default_factory=list)

    def add(self, t: dict) -> None:
        nll, nb, kld, pd = t["nll"], t["nll_base"], t["kld"], t["p_diff"].double()
        self.nll += float(nll.sum()); self.nll2 += float((nll * nll).sum())  # noqa: E702
        self.nll_base += float(nb.sum()); self.nll_base2 += float((nb * nb).sum())  # noqa: E702
        self.nll_nll_base += float((nll * nb).sum())
        self.kld += float(kld.sum()); self.kld2 += float((kld * kld).sum())  # noqa: E702
        self.p_diff += float(pd.sum()); self.p_diff2 += float((pd * pd).sum())  # noqa: E702
        self.p_diff4 += float((pd**4).sum())
        self.n_same_top += int(t["same_top"].sum())
        self.count += nll.numel()
        self.kld_values.append(kld.float().numpy())
        self.p_diff_values.append(pd.float().numpy())

    def summary(self) -> dict:
        """Every figure llama.cpp prints after a --kl-divergence run, as plain floats."""
        n = self.count
        lp, lp_err = mean_and_uncertainty(self.nll, self.nll2, n)
        lb, lb_err = mean_and_uncertainty(self.nll_base, self.nll_base2, n)
        cov = covariance(self.nll, self.nll_base, self.nll_nll_base, n)
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        ratio = lp - lb
        ratio_err = math.sqrt(max(lp_err**2 + lb_err**2 - 2 * cov, 0.0))
        ppl_err, ppl_base_err = ppl * lp_err, ppl_base * lb_err
        kld, kld_err = mean_and_uncertainty(self.kld, self.kld2, n)
        mse, mse_err = mean_and_uncertainty(self.p_diff2, self.p_diff4, n)
        rms = math.sqrt(mse)
        pd, pd_err = mean_and_uncertainty(self.p_diff, self.p_diff2, n)
        same = self.n_same_top / n
        import numpy as np

        kv = np.sort(np.concatenate(self.kld_values))
        dv = np.sort(np.concatenate(self.p_diff_values))
        return dict(
            count=n, ppl=ppl, ppl_err=ppl_err, ppl_base=ppl_base, ppl_base_err=ppl_base_err,
            cor=_safe_div(cov, lp_err * lb_err), ln_ratio=ratio, ln_ratio_err=ratio_err,
            ppl_ratio=math.exp(ratio), ppl_ratio_err=math.exp(ratio) * ratio_err, ppl_diff=ppl - ppl_base,
            ppl_diff_err=math.sqrt(max(ppl_err**2 + ppl_base_err**2 - 2 * ppl * ppl_base * cov, 0.0)),
            kld=kld, kld_err=kld_err, kld_max=float(kv[-1]), kld_median=median(kv), kld_min=float(kv[0]),
            kld_pct={f: percentile(kv, f) for f in (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)},
            p_diff=pd, p_diff_err=pd_err, p_diff_max=float(dv[-1]), p_diff_median=median(dv),
            p_diff_min=float(dv[0]),
            p_diff_pct={f: percentile(dv, f) for f in (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)},
            rms_p_diff=rms, rms_p_diff_err=(0.5 / rms * mse_err if rms > 0 else 0.0),
            same_top=same, same_top_err=(math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0),
        )

    def chunk_line(self, chunk: int) -> str:
        """One row of llama.cpp's running KLD table (cumulative up to this chunk)."""
        n = self.count
        lp, lp_err = mean_and_uncertainty(self.nll, self.nll2, n)
        lb, lb_err = mean_and_uncertainty(self.nll_base, self.nll_base2, n)
        cov = covariance(self.nll, self.nll_base, self.nll_nll_base, n)
        ratio_err = math.sqrt(max(lp_err**2 + lb_err**2 - 2 * cov, 0.0))
        kld, kld_err = mean_and_uncertainty(self.kld, self.kld2, n)
        mse, mse_err = mean_and_uncertainty(self.p_diff2, self.p_diff4, n)
        rms = math.sqrt(mse)
        same = self.n_same_top / n
        return (f"{chunk:4d}    {math.exp(lp):9.4f} ± {math.exp(lp) * lp_err:9.4f}    {lp - lb:10.5f} ± {ratio_err:10.5f}"
                f"    {kld:10.5f} ± {kld_err:10.5f}"
                f"    {100 * rms:6.3f} ± {100 * (0.5 / rms * mse_err if rms > 0 else 0.0):6.3f} %"
                f"    {100 * same:6.3f} ± {100 * (math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0):6.3f} %")


KLD_TABLE_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                    "              Δp RMS            Same top p")


def kld_report(s: dict) -> list[str]:
    """llama.cpp's three closing blocks for a --kl-divergence run."""
    pct = lambda f: f"{100 * f:.1f}%".rjust(5)  # noqa: E731  (" 5.0%", "99.9%")
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_err']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_err']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ratio']:10.6f} ± {s['ln_ratio_err']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_err']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_err']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['kld']:10.6f} ± {s['kld_err']:10.6f}",
        f"Maximum KLD: {s['kld_max']:10.6f}",
        *[f"{pct(f)}   KLD: {s['kld_pct'][f]:10.6f}" for f in (0.999, 0.99, 0.95, 0.90)],
        f"Median  KLD: {s['kld_median']:10.6f}",
        *[f"{pct(f)}   KLD: {s['kld_pct'][f]:10.6f}" for f in (0.10, 0.05, 0.01, 0.001)],
        f"Minimum KLD: {s['kld_min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s['p_diff']:6.3f} ± {100 * s['p_diff_err']:5.3f} %",
        f"Maximum Δp: {100 * s['p_diff_max']:6.3f}%",
        *[f"{pct(f)}   Δp: {100 * s['p_diff_pct'][f]:6.3f}%" for f in (0.999, 0.99, 0.95, 0.90, 0.75)],
        f"Median  Δp: {100 * s['p_diff_median']:6.3f}%",
        *[f"{pct(f)}   Δp: {100 * s['p_diff_pct'][f]:6.3f}%" for f in (0.25, 0.10, 0.05, 0.01, 0.001)],
        f"Minimum Δp: {100 * s['p_diff_min']:6.3f}%",
        f"RMS Δp    : {100 * s['rms_p_diff']:6.3f} ± {100 * s['rms_p_diff_err']:5.3f} %",
        f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_err']:5.3f} %",
    ]
    return lines


# ---------------------------------------------------------------------------------------------
# The base file
# ---------------------------------------------------------------------------------------------

def _record_dtype(n_vocab: int) -> "np.dtype":
    import numpy as np

    return np.dtype([("nll", "<f4"), ("scale", "<f4"), ("min_log_prob", "<f4"), ("q", "<u2", (n_vocab,))])


class BaseWriter:
    """Streams a base run's quantized log-probs to FILE, chunk by chunk (format: module docstring)."""

    def __init__(self, path: Path, header: dict, tokens: list[int]):
        import numpy as np

        self.path = Path(path)
        self.part = self.path.with_name(f".{self.path.name}.part")  # renamed into place only when complete
        self.records = _record_dtype(header["n_vocab"])
        try:
            self.f = open(self.part, "wb")
        except OSError as e:
            raise KvcliError(f"cannot write {path}: {e.strerror}") from None
        blob = json.dumps(dict(header, version=KLD_VERSION), sort_keys=True).encode()
        self.f.write(KLD_MAGIC + struct.pack("<I", len(blob)) + blob)
        self.f.write(np.asarray(tokens, dtype="<i4").tobytes())

    def add(self, log_probs: "torch.Tensor", targets: "torch.Tensor") -> None:
        import numpy as np

        scale, low, q = quantize_log_probs(log_probs)
        rec = np.empty(len(scale), dtype=self.records)
        rec["nll"] = token_nll(log_probs, targets).numpy()
        rec["scale"], rec["min_log_prob"], rec["q"] = scale.numpy(), low.numpy(), q.numpy()
        self.f.write(rec.tobytes())

    def close(self, complete: bool) -> None:
        """complete: rename the file into place; otherwise remove it (never a half-written base)."""
        self.f.close()
        if complete:
            os.replace(self.part, self.path)
        else:
            self.part.unlink(missing_ok=True)


@dataclass
class Base:
    header: dict
    tokens: np.ndarray  # (n_chunk * n_ctx,) int32
    records: np.ndarray  # memmap of n_chunk * n_scored records

    def chunk(self, i: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Chunk i: dequantized base log-probs (n_scored, V) f32 and the exact target NLL (n_scored,)."""
        import numpy as np
        import torch

        s = self.header["n_scored"]
        r = self.records[i * s : (i + 1) * s]
        log_probs = dequantize_log_probs(torch.from_numpy(np.ascontiguousarray(r["scale"])),
                                         torch.from_numpy(np.ascontiguousarray(r["min_log_prob"])),
                                         torch.from_numpy(r["q"].astype(np.int32)))
        return log_probs, torch.from_numpy(np.ascontiguousarray(r["nll"]))


def read_base(path: Path) -> Base:
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise KvcliError(f"KL-divergence base file not found: {path}")
    with open(path, "rb") as f:
        if f.read(8) != KLD_MAGIC:
            raise KvcliError(f"{path} is not a kvcli KL-divergence base file (write one with --kl-divergence-base)")
        (n,) = struct.unpack("<I", f.read(4))
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise KvcliError(f"{path}: damaged header") from None
    if header.get("version") != KLD_VERSION:
        raise KvcliError(f"{path}: base file version {header.get('version')}, this kvcli reads {KLD_VERSION}")
    offset = 12 + n
    n_tok = header["n_chunk"] * header["n_ctx"]
    records = _record_dtype(header["n_vocab"])
    expect = offset + 4 * n_tok + records.itemsize * header["n_chunk"] * header["n_scored"]
    if path.stat().st_size != expect:
        raise KvcliError(f"{path} is truncated or damaged: {path.stat().st_size} bytes, expected {expect}")
    tokens = np.fromfile(path, dtype="<i4", count=n_tok, offset=offset)
    recs = np.memmap(path, dtype=records, mode="r", offset=offset + 4 * n_tok,
                     shape=(header["n_chunk"] * header["n_scored"],))
    return Base(header, tokens, recs)


def check_base(base: Base, tokens: list[int], n_ctx: int, n_vocab: int, n_chunks: int, bos_id: int | None):
    """-> (inputs, targets) for the base's chunks, or a KvcliError saying what differs."""
    import numpy as np

    h = base.header
    if h["n_ctx"] != n_ctx:
        raise KvcliError(f"the KL-divergence base was computed with -c {h['n_ctx']}, this run uses -c {n_ctx}")
    if h["n_vocab"] != n_vocab:
        raise KvcliError(f"the KL-divergence base has a {h['n_vocab']}-token vocabulary, this model {n_vocab}")
    if n_chunks > h["n_chunk"]:
        raise KvcliError(f"--chunks {n_chunks}: the KL-divergence base holds only {h['n_chunk']} chunks")
    n_chunk = h["n_chunk"] if n_chunks < 0 else n_chunks
    if len(tokens) < n_chunk * n_ctx or not np.array_equal(np.asarray(tokens[: n_chunk * n_ctx]),
                                                           base.tokens[: n_chunk * n_ctx]):
        raise KvcliError("the text tokenizes differently from the KL-divergence base's "
                         "(another file, model vocabulary or tokenizer); recompute the base")
    if h["bos_id"] != bos_id:
        raise KvcliError(f"the KL-divergence base put BOS {h['bos_id']} at each chunk's start, this model {bos_id}")
    return make_chunks(tokens, n_ctx, n_chunk, bos_id)


# ---------------------------------------------------------------------------------------------
# Running chunks through a model
# ---------------------------------------------------------------------------------------------

def balanced_n_seq(batch_size: int, n_ctx: int, n_chunk: int) -> int:
    """llama.cpp's n_seq = max(1, b // c), capped at n_chunk and evened out so the last batch is
    not mostly padding (Llama.logits pads a short batch with copies)."""
    n_seq = min(max(1, batch_size // n_ctx), n_chunk)
    n_batches = -(-n_chunk // n_seq)
    return -(-n_chunk // n_batches)


def chunk_log_probs(llm, inputs: "torch.Tensor", n_seq: int) -> Iterable[tuple[int, "torch.Tensor"]]:
    """Yield (chunk index, scored log-probs (n_scored, V) f32), running n_seq chunks per forward."""
    n_ctx = inputs.shape[1]
    for i in range(0, inputs.shape[0], n_seq):
        logits = llm.logits(inputs[i : i + n_seq])  # (B, n_ctx, V), fresh cache
        lp = scored_log_probs(logits, n_ctx)
        del logits
        for b in range(lp.shape[0]):
            yield i + b, lp[b]


def cache_like(llm, type_k: str, type_v: str):
    """A KVCache shaped like llm's, of other storage types (the sweep swaps it in: one model in memory)."""
    from kvcli.cache import KVCache

    c = llm.cache
    return KVCache(c.n_layers, c.batch, c.k.n_heads, c.n_ctx, c.k.head_dim, type_k, type_v, device=c.k.device,
                   flash_attn=c.flash_attn)


def cache_mib(config, n_ctx: int, type_k: str, type_v: str) -> float:
    from kvcli.cache import KVCache

    return KVCache.bytes_needed(config.n_layers, 1, config.kv_dim, n_ctx, type_k, type_v) / MIB


def parse_pairs(spec: str) -> list[tuple[str, str]]:
    """"f16/f16,q8_0/q4_0,q8_0" -> canonical (K, V) names; a lone name is used for both, and
    "all" stands for every registered storage type (K = V), so new cache types join the sweep."""
    from kvcli.cache import STORAGE_TYPES, resolve_type

    pairs = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() == "all":
            found = [(name, name) for name in STORAGE_TYPES]
        else:
            k, _, v = item.partition("/")
            found = [(resolve_type(k.strip()).name, resolve_type((v or k).strip()).name)]
        pairs += [p for p in found if p not in pairs]
    if not pairs:
        raise KvcliError("--sweep needs K/V pairs, e.g. f16/f16,q8_0/q8_0")
    return pairs


def sweep(llm, inputs, targets, n_seq: int, pairs: list[tuple[str, str]], base_pair: tuple[str, str],
          tick: Callable[[], None] = lambda: None) -> list[dict]:
    """One row per (K, V) pair against the base pair's run, chunk batch by chunk batch (no base file).

    The base log-probs go through the base file's 16-bit rounding, so each row equals what
    --kl-divergence against a saved base reports; the base pair's own row is the base itself (KLD 0)."""
    from kvcli.cache import resolve_type

    n_ctx = inputs.shape[1]
    base_cache = llm.cache
    caches = {p: cache_like(llm, *p) for p in pairs if p != base_pair}
    base_stats, seconds = PplStats(), dict.fromkeys(pairs, 0.0)
    seconds[base_pair] = 0.0
    klds = {p: KldStats() for p in pairs}
    try:
        for i in range(0, inputs.shape[0], n_seq):
            batch, tgt = inputs[i : i + n_seq], targets[i : i + n_seq]
            t0 = time.perf_counter()
            llm.cache = base_cache
            base_lp = scored_log_probs(llm.logits(batch), n_ctx)  # (B, S, V)
            base_nll = token_nll(base_lp, tgt)  # (B, S)
            base_stats.add(base_nll)
            seconds[base_pair] += time.perf_counter() - t0
            base_q = [dequantize_log_probs(*quantize_log_probs(base_lp[b])) for b in range(len(batch))]
            if base_pair in klds:
                for b in range(len(batch)):
                    klds[base_pair].add(kld_terms(base_lp[b], base_lp[b], tgt[b]))
            tick()
            for pair, cache in caches.items():
                t0 = time.perf_counter()
                llm.cache = cache
                lp = scored_log_probs(llm.logits(batch), n_ctx)
                for b in range(len(batch)):
                    klds[pair].add(kld_terms(lp[b], base_q[b], tgt[b], base_nll[b]))
                del lp
                seconds[pair] += time.perf_counter() - t0
                tick()
            del base_lp, base_q
    finally:
        llm.cache = base_cache
    base_ppl = base_stats.ppl
    rows = []
    for k, v in pairs:
        s = klds[(k, v)].summary()
        rows.append(dict(
            type_k=k, type_v=v,
            bits_per_element=(resolve_type(k).bits_per_element() + resolve_type(v).bits_per_element()) / 2,
            cache_mib=cache_mib(llm.config, n_ctx, k, v), cache_mib_32k=cache_mib(llm.config, 32768, k, v),
            ppl=s["ppl"], ppl_err=s["ppl_err"], delta_ppl_pct=100 * (s["ppl"] / base_ppl - 1),
            mean_kld=s["kld"], mean_kld_err=s["kld_err"], kld_99=s["kld_pct"][0.99], same_top_pct=100 * s["same_top"],
            rms_p_diff_pct=100 * s["rms_p_diff"], seconds=seconds[(k, v)],
        ))
    return rows


def sweep_table(rows: list[dict], base_pair: tuple[str, str], n_ctx: int):
    from rich.table import Table

    t = Table(title=f"KV cache types against {base_pair[0]}/{base_pair[1]} (n_ctx {n_ctx})")
    for name in ("K", "V", "bits/el", f"MiB @{n_ctx}", "MiB @32k", "PPL", "ΔPPL %", "mean KLD", "same top %", "s"):
        t.add_column(name, justify="left" if name in ("K", "V") else "right")
    for r in rows:
        t.add_row(r["type_k"], r["type_v"], f"{r['bits_per_element']:.2f}", f"{r['cache_mib']:.2f}",
                  f"{r['cache_mib_32k']:.1f}", f"{r['ppl']:.4f} ± {r['ppl_err']:.4f}", f"{r['delta_ppl_pct']:+.3f}",
                  f"{r['mean_kld']:.6f}".replace("-0.000000", "0.000000"),  # rounding noise below 1e-6
                  f"{r['same_top_pct']:.2f}", f"{r['seconds']:.1f}")
    return t


def plot_sweep(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["bits_per_element"], r["mean_kld"], color="tab:blue")
        label = r["type_k"] if r["type_k"] == r["type_v"] else f"{r['type_k']}/{r['type_v']}"
        ax.annotate(label, (r["bits_per_element"], r["mean_kld"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("bits per element (mean of K and V)")
    ax.set_ylabel("mean KL divergence vs base (nats)")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise KvcliError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def _write_json(path: Path, data: dict) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise KvcliError(f"cannot write {path}: {e.strerror}") from None


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def perplexity_command(
    model: Optional[Path] = typer.Option(None, "-m", "--model", help="GGUF model file (default: SmolLM2-135M-Instruct Q4_1)."),
    file: Path = typer.Option(..., "-f", "--file", help="Text to score, e.g. wikitext-2-raw/wiki.test.raw."),
    ctx_size: int = typer.Option(512, "-c", "--ctx-size", help="Tokens per chunk; the second half of each is scored."),
    batch_size: int = typer.Option(2048, "-b", "--batch-size",
                                   help="Tokens per forward pass: b // c chunks run together as sequences."),
    chunks: int = typer.Option(-1, "--chunks", help="Chunks to score (-1: all)."),
    cache_type_k: Optional[str] = typer.Option(None, "-ctk", "--cache-type-k", help="K cache type, default f16 (the sweep's base too)."),
    cache_type_v: Optional[str] = typer.Option(None, "-ctv", "--cache-type-v", help="V cache type, default f16 (the sweep's base too)."),
    cache_mode: str = typer.Option("kv", "--cache-mode", help="kv, hidden (store each layer's input, rebuild K/V) or auto."),
    cache_type_h: Optional[str] = typer.Option(None, "-cth", "--cache-type-h", help="Hidden-state cache type (default f16)."),
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype of the weights: f32, f16 or bf16."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads (default: torch's choice)."),
    kl_divergence_base: Optional[Path] = typer.Option(
        None, "--kl-divergence-base", help="Base log-probs file: written by a plain run, read with --kl-divergence."),
    kl_divergence: bool = typer.Option(False, "--kl-divergence", help="Compare this run against --kl-divergence-base."),
    flash_attn: str = typer.Option("auto", "-fa", "--flash-attn", help="Attention: on (online softmax), off, auto = on."),
    sweep_spec: Optional[str] = typer.Option(
        None, "--sweep", help="K/V pairs to compare with the -ctk/-ctv base in one run, e.g. f16/f16,q8_0/q8_0 "
                              "('all': every cache type)."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the results (sweep rows) as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With --sweep: draw mean KLD against bits per element (PNG)."),
):
    """Perplexity of a text with llama-perplexity's method; KL divergence against a base; cache sweep."""
    from kvcli.cli import err, log, parse_flash_attn, read_prompt, resolve_model, user_errors

    with user_errors():
        from kvcli.cache import resolve_type

        from kvcli.cache import validate_cache_flags

        validate_cache_flags(cache_mode, cache_type_k is not None, cache_type_v is not None, cache_type_h is not None)
        cache_type_k, cache_type_v, cache_type_h = (t or "f16" for t in (cache_type_k, cache_type_v, cache_type_h))
        resolve_type(cache_type_h)
        flash = parse_flash_attn(flash_attn)
        if sweep_spec is not None and cache_mode != "kv":
            raise KvcliError("--sweep compares K/V cache types; it runs with --cache-mode kv")
        base_pair = (resolve_type(cache_type_k).name, resolve_type(cache_type_v).name)
        pairs = parse_pairs(sweep_spec) if sweep_spec is not None else None
        if ctx_size <= 0:
            raise KvcliError("perplexity needs -c > 0")
        if kl_divergence and kl_divergence_base is None:
            raise KvcliError("--kl-divergence reads the base from --kl-divergence-base FILE")
        if pairs and kl_divergence_base is not None:
            raise KvcliError("--sweep computes its base in memory; drop --kl-divergence-base / --kl-divergence")
        if plot is not None:
            if not pairs:
                raise KvcliError("--plot draws a --sweep; add --sweep")
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise KvcliError("--plot needs matplotlib: pip install 'kvcli[plot]'") from None
        base = read_base(kl_divergence_base) if kl_divergence else None
        text = read_prompt(None, file)
        path = resolve_model(model)

        from kvcli.gguf_file import open_gguf
        from kvcli.llama import Llama
        from kvcli.tokenizer import Tokenizer

        g = open_gguf(path)
        t0 = time.perf_counter()
        log("perplexity: tokenizing the input ..")
        tok = Tokenizer.from_metadata(g.metadata)
        tokens = tok.encode(text, add_bos=None, parse_special=False)
        log(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t0):g} ms")
        bos_id = tok.bos_id if tok.add_bos else None
        if base is not None:
            inputs, targets = check_base(base, tokens, ctx_size, g.config.vocab_size, chunks, bos_id)
        else:
            inputs, targets = make_chunks(tokens, ctx_size, chunks, bos_id)
        n_chunk = inputs.shape[0]
        n_seq = balanced_n_seq(batch_size, ctx_size, n_chunk)
        llm = Llama(path, ctx_size=ctx_size, dtype=dtype, cache_type_k=base_pair[0], cache_type_v=base_pair[1],
                    batch_size=min(batch_size, ctx_size), n_seq=n_seq, threads=threads, flash_attn=flash, log=log,
                    cache_mode=cache_mode, cache_type_h=cache_type_h)
        if ctx_size > llm.config.context_length:
            log(f"warning: -c {ctx_size} exceeds the model's training context ({llm.config.context_length})")
        log(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={ctx_size}, "
            f"batch_size={batch_size}, n_seq={n_seq}")

        header = dict(model=path.name, n_vocab=llm.config.vocab_size, n_ctx=ctx_size, n_chunk=n_chunk,
                      first=first_scored(ctx_size), n_scored=n_scored(ctx_size), bos_id=bos_id, dtype=dtype,
                      cache_type_k=base_pair[0], cache_type_v=base_pair[1], cache_mode=llm.cache_mode,
                      cache_type_h=cache_type_h)
        t_start = time.perf_counter()
        with _progress(err) as progress:
            if pairs:
                n_passes = -(-n_chunk // n_seq) * (1 + sum(p != base_pair for p in pairs))
                task = progress.add_task("sweep", total=n_passes)
                rows = sweep(llm, inputs, targets, n_seq, pairs, base_pair, lambda: progress.advance(task))
            else:
                task = progress.add_task("perplexity", total=n_chunk)
                writer = None
                if kl_divergence_base is not None and base is None:
                    writer = BaseWriter(kl_divergence_base, header, tokens[: n_chunk * ctx_size])
                result = _run_one(llm, inputs, targets, n_seq, base, writer, progress, task, log)
        seconds = time.perf_counter() - t_start

        if pairs:
            from rich.console import Console

            out = Console(highlight=False)
            if not out.is_terminal:  # a file or pipe: do not squeeze the table into 80 columns
                out = Console(highlight=False, width=160)
            out.print(sweep_table(rows, base_pair, ctx_size))
            log(f"perplexity: sweep of {len(pairs)} cache types over {n_chunk} chunks took {seconds:.1f} s")
            meta = {k: v for k, v in header.items() if not k.startswith("cache_type")}
            if json_file is not None:
                _write_json(json_file, dict(meta, base_type_k=base_pair[0], base_type_v=base_pair[1],
                                            seconds=seconds, rows=rows))
            if plot is not None:
                plot_sweep(rows, plot, f"{path.name}, {Path(file).name}, n_ctx {ctx_size}, {n_chunk} chunks, "
                           f"dtype {dtype}")
                log(f"perplexity: plot written to {plot}")
        else:
            log(f"perplexity: {n_chunk} chunks took {seconds:.2f} s")
            if json_file is not None:
                _write_json(json_file, dict(header, seconds=seconds, **result))
            if result.get("interrupted"):
                raise typer.Exit(130)


def _run_one(llm, inputs, targets, n_seq: int, base: Base | None, writer: "BaseWriter | None",
             progress, task, log) -> dict:
    """A plain run (optionally saving the base) or a --kl-divergence run; prints llama.cpp's lines."""
    n_chunk = inputs.shape[0]
    stats, kld = PplStats(), KldStats()
    t_pass = time.perf_counter()
    done = interrupted = False
    try:
        for i, lp in chunk_log_probs(llm, inputs, n_seq):
            if i == 0:  # llama.cpp's first-pass timing line
                t = time.perf_counter() - t_pass
                log(f"perplexity: {t:.2f} seconds per pass - ETA {t * n_chunk / n_seq / 60:.2f} minutes")
            if base is None:
                stats.add(token_nll(lp, targets[i]))
                if writer is not None:
                    writer.add(lp, targets[i])
                # on a terminal the line shows whole at the end, above the bar (which shows the running PPL)
                print(f"[{i + 1}]{stats.ppl:.4f},", end="", flush=not sys.stdout.isatty())
                progress.update(task, advance=1, description=f"[{i + 1}] PPL {stats.ppl:.4f}")
            else:
                if i == 0:
                    print(KLD_TABLE_HEADER, flush=True)
                log_base, nll_base = base.chunk(i)
                kld.add(kld_terms(lp, log_base, targets[i], nll_base))
                print(kld.chunk_line(i + 1), flush=True)
                progress.update(task, advance=1, description=f"[{i + 1}] KLD {kld.kld / kld.count:.6f}")
        done = True
    except KeyboardInterrupt:  # Ctrl-C: report the estimate over the chunks scored so far
        interrupted = True
        log("perplexity: interrupted; the estimate below covers the chunks scored so far")
    finally:
        if writer is not None:
            writer.close(complete=done)
    print(flush=True)
    if (stats.count if base is None else kld.count) == 0:
        return dict(interrupted=interrupted)
    if base is not None:
        s = kld.summary()
        for line in kld_report(s):
            print(line)
        return dict(kld={k: v for k, v in s.items() if not isinstance(v, dict)}, interrupted=interrupted)
    ppl, err = stats.estimate()
    if math.isnan(err):
        log("Unexpected negative standard deviation of log(prob)")
        print(f"Final estimate: PPL = {ppl:.4f}")
    else:
        print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")
    if writer is not None and not interrupted:
        log(f"perplexity: base log-probs written to {writer.path}")
    return dict(ppl=ppl, ppl_err=err, count=stats.count, interrupted=interrupted)
