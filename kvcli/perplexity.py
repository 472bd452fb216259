"""`kvcli perplexity`: llama-perplexity's method and output, KL divergence against a base, a cache sweep.

The method is llama.cpp's (tools/perplexity/perplexity.cpp, `perplexity()`):
tokenize the whole text (BOS as the vocab says), cut it into n_chunk = n_tokens // n_ctx chunks of
n_ctx tokens, set the first token of each chunk to BOS where the vocab adds one, and score the
positions first = n_ctx // 2 .. n_ctx - 2 of each chunk (each predicts the next, original token):
n_ctx - 1 - n_ctx // 2 tokens per chunk (255 at -c 512). PPL = exp(mean NLL); the error is
llama.cpp's ppl * sqrt((<nll^2> - <nll>^2) / (count - 1)).

Memory: one forward's logits are live at a time, and of them one block of SCORE_ROWS positions'
log-softmax (and KLD terms); each block is reduced to per-position figures before the next.

The KLD statistics are kvcli/kld.py, the base file kvcli/logprob_base.py, the cache sweep
kvcli/sweep.py and the command kvcli/commands/perplexity.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from kvcli.errors import KvcliError

if TYPE_CHECKING:  # torch and numpy are imported lazily so that `kvcli --help` stays instant
    import torch


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


def balanced_n_seq(batch_size: int, n_ctx: int, n_chunk: int) -> int:
    """llama.cpp's n_seq = max(1, b // c), capped at n_chunk and evened out so the last batch is
    not mostly padding (Llama.logits pads a short batch with copies)."""
    n_seq = min(max(1, batch_size // n_ctx), n_chunk)
    n_batches = -(-n_chunk // n_seq)
    return -(-n_chunk // n_batches)


SCORE_ROWS = 16  # scored positions whose full-vocabulary log-probs (and KLD terms) are live at once


def chunk_logits(llm, inputs: "torch.Tensor", n_seq: int, cache=None) -> Iterable[tuple[int, Iterable]]:
    """Yield (chunk index, its scored positions' logits as blocks (row offset, (r, V) f32)), running n_seq chunks per
    forward (fresh cache each); consume a chunk's blocks before asking for the next chunk. Only those rows go through
    the output head, and one forward batch's are live at a time: a lone chunk's blocks are its forward batches as
    they come (at -c 32768 its 16k scored rows would be 10 GB in f32 for a 152k vocabulary), several chunks' one
    block each, of the forward that made them."""
    n_ctx = inputs.shape[1]
    first = first_scored(n_ctx)
    for i in range(0, inputs.shape[0], n_seq):
        batches = llm.logit_batches(inputs[i : i + n_seq], cache=cache, first=first, stop=first + n_scored(n_ctx))
        if min(n_seq, inputs.shape[0] - i) == 1:
            yield i, ((lo, logits[0]) for lo, logits in batches)
            continue
        blocks = list(batches)  # several chunks: each batch holds rows of all of them
        for b in range(blocks[0][1].shape[0]):
            yield i + b, [(lo, logits[b]) for lo, logits in blocks]
        del blocks


def score_chunk(blocks: Iterable, score: Callable, rows: int | None = None):
    """Apply score(positions, log_probs) to one chunk's scored positions, `rows` at a time, and
    concatenate what it returns (a tensor (r,) or a dict of them) into (n_scored,) per key.

    blocks: the chunk's scored logits as (row offset, logits (r, V)) (chunk_logits'); positions is a slice of
    0..n_scored-1 (index targets with it) and log_probs its f32 log-softmax: only one such block of the vocabulary-wide
    terms is live at a time. Row-wise operations give each position the same bits whatever `rows` is."""
    import torch

    rows = SCORE_ROWS if rows is None else rows
    parts = []
    for lo, logits in blocks:
        n = logits.shape[0]
        for r in range(0, n, rows):
            lp = torch.log_softmax(logits[r : r + rows].float(), dim=-1)
            parts.append(score(slice(lo + r, lo + min(r + rows, n)), lp))
            del lp
        del logits  # before the next block is made: one batch's logits live at a time
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts)
