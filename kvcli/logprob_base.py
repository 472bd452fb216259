"""The KL-divergence base file (`--kl-divergence-base FILE`), little-endian, version 2:

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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcli.errors import KvcliError
from kvcli.kld import LOG_PROB_FLOOR
from kvcli.perplexity import make_chunks, token_nll

if TYPE_CHECKING:  # torch and numpy are imported lazily so that `kvcli --help` stays instant
    import numpy as np
    import torch

KLD_MAGIC = b"KVCLIKLD"
KLD_VERSION = 2


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


def record_dtype(n_vocab: int) -> "np.dtype":
    import numpy as np

    return np.dtype([("nll", "<f4"), ("scale", "<f4"), ("min_log_prob", "<f4"), ("q", "<u2", (n_vocab,))])


def to_records(log_probs: "torch.Tensor", nll: "torch.Tensor", records: "np.dtype") -> "np.ndarray":
    """(r, V) f32 log-softmax and the targets' NLL (r,) -> r records of the file's 16-bit form."""
    import numpy as np

    scale, low, q = quantize_log_probs(log_probs)
    rec = np.empty(len(scale), dtype=records)
    rec["nll"] = nll.numpy()
    rec["scale"], rec["min_log_prob"], rec["q"] = scale.numpy(), low.numpy(), q.numpy()
    return rec


def from_records(rec: "np.ndarray") -> tuple["torch.Tensor", "torch.Tensor"]:
    """r records -> dequantized log-probs (r, V) f32 and the exact target NLL (r,) f32."""
    import numpy as np
    import torch

    # np.array copies the fields (strided in the records) into arrays of their own
    log_probs = dequantize_log_probs(torch.from_numpy(np.array(rec["scale"])),
                                     torch.from_numpy(np.array(rec["min_log_prob"])),
                                     torch.from_numpy(rec["q"].astype(np.int32)))
    return log_probs, torch.from_numpy(np.array(rec["nll"]))


class BaseWriter:
    """Streams a base run's quantized log-probs to FILE, a block of positions at a time (format: module docstring)."""

    def __init__(self, path: Path, header: dict, tokens: list[int]):
        import numpy as np

        self.path = Path(path)
        self.part = self.path.with_name(f".{self.path.name}.part")  # renamed into place only when complete
        self.records = record_dtype(header["n_vocab"])
        try:
            self.f = open(self.part, "wb")
        except OSError as e:
            raise KvcliError(f"cannot write {path}: {e.strerror}") from None
        blob = json.dumps(dict(header, version=KLD_VERSION), sort_keys=True).encode()
        self.f.write(KLD_MAGIC + struct.pack("<I", len(blob)) + blob)
        self.f.write(np.asarray(tokens, dtype="<i4").tobytes())

    def add(self, log_probs: "torch.Tensor", targets: "torch.Tensor") -> None:
        """The next scored positions' log-softmax (r, V) f32 and targets (r,), in file order."""
        self.f.write(to_records(log_probs, token_nll(log_probs, targets), self.records).tobytes())

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
    path: Path
    start: int  # byte offset of the first of n_chunk * n_scored records

    def rows(self, i: int, pos: slice) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Chunk i, scored positions pos: dequantized base log-probs (r, V) f32 and exact target NLL (r,).
        Read, not memory-mapped: a mapping's pages would stay in the process, up to the whole file."""
        import numpy as np

        records = record_dtype(self.header["n_vocab"])
        first = i * self.header["n_scored"] + pos.start
        return from_records(np.fromfile(self.path, dtype=records, count=pos.stop - pos.start,
                                        offset=self.start + first * records.itemsize))


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
    records = record_dtype(header["n_vocab"])
    expect = offset + 4 * n_tok + records.itemsize * header["n_chunk"] * header["n_scored"]
    if path.stat().st_size != expect:
        raise KvcliError(f"{path} is truncated or damaged: {path.stat().st_size} bytes, expected {expect}")
    tokens = np.fromfile(path, dtype="<i4", count=n_tok, offset=offset)
    return Base(header, tokens, path, offset + 4 * n_tok)


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
