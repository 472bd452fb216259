"""kvcli's perplexity against transformers' on the same GGUF, same tokens, same chunks, in one run.

    python benchmarks/perplexity_reference.py                        # default model, WikiText-2, -c 512, 20 chunks
    python benchmarks/perplexity_reference.py -m M.gguf -f FILE -c 512 --chunks 20 -b 2048

Both decoders get kvcli's chunk inputs (llama-perplexity's method, `kvcli.perplexity.make_chunks`),
and both logits go through the same scoring code, so the gap is the decoder's alone. The tokenizer
is checked separately against transformers' GGUF tokenizer: where the ids differ, transformers'
PPL on its own ids is printed too (then the gap between the two transformers figures is the
tokenizer's). Reference on the default model, WikiText-2 test, -c 512, 20 chunks: transformers f32
26.926, llama.cpp `Final estimate: PPL = 27.0452 +/- 1.17462` (about 38 s).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvcli.llama import Llama
from kvcli.catalog import default_model_path
from kvcli.perplexity import PplStats, balanced_n_seq, chunk_logits, make_chunks, score_chunk, scored_log_probs, token_nll

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def run_kvcli(path, inputs, targets, n_seq, args) -> tuple[PplStats, float]:
    llm = Llama(path, ctx_size=inputs.shape[1], dtype=args.dtype, cache_type_k=args.ctk, cache_type_v=args.ctv,
                batch_size=min(args.batch_size, inputs.shape[1]), n_seq=n_seq, threads=args.threads)
    stats, t0 = PplStats(), time.perf_counter()
    for i, logits in chunk_logits(llm, inputs, n_seq):
        stats.add(score_chunk(logits, lambda pos, lp: token_nll(lp, targets[i, pos])))
        del logits
        print(f"[{i + 1}]{stats.ppl:.4f},", end="", flush=True)
    print()
    return stats, time.perf_counter() - t0


def run_transformers(hf, inputs, targets, n_seq) -> tuple[PplStats, float]:
    stats, t0 = PplStats(), time.perf_counter()
    n_ctx = inputs.shape[1]
    for i in range(0, inputs.shape[0], n_seq):
        with torch.no_grad():
            logits = hf(input_ids=inputs[i : i + n_seq]).logits  # (B, n_ctx, V)
        lp = scored_log_probs(logits, n_ctx)
        del logits
        for b in range(lp.shape[0]):
            stats.add(token_nll(lp[b], targets[i + b]))
            print(f"[{i + b + 1}]{stats.ppl:.4f},", end="", flush=True)
    print()
    return stats, time.perf_counter() - t0


def line(name: str, stats: PplStats, seconds: float) -> str:
    ppl, err = stats.estimate()
    return f"{name:<28} Final estimate: PPL = {ppl:.4f} +/- {err:.5f}   ({stats.count} tokens, {seconds:.1f} s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=default_model_path())
    ap.add_argument("-f", "--file", type=Path, default=WIKITEXT)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-ctv", default="f16")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-hf-tokenizer", action="store_true", help="skip the transformers tokenizer comparison")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    text = args.file.read_text(encoding="utf-8")
    llm_tok = Llama(args.model, ctx_size=args.ctx_size)
    t0 = time.perf_counter()
    tokens = llm_tok.tokenize(text)
    print(f"kvcli tokenizer: {len(tokens)} tokens in {time.perf_counter() - t0:.2f} s, "
          f"add_bos={llm_tok.tokenizer.add_bos}")
    bos = llm_tok.tokenizer.bos_id if llm_tok.tokenizer.add_bos else None
    del llm_tok
    inputs, targets = make_chunks(tokens, args.ctx_size, args.chunks, bos)
    n_seq = balanced_n_seq(args.batch_size, args.ctx_size, inputs.shape[0])
    print(f"{inputs.shape[0]} chunks of {args.ctx_size}, n_seq={n_seq}, {targets.numel()} scored tokens")

    kv, kv_s = run_kvcli(args.model, inputs, targets, n_seq, args)
    print(line(f"kvcli ({args.dtype}, {args.ctk}/{args.ctv})", kv, kv_s))

    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(args.model.parent, gguf_file=args.model.name,
                                              dtype=torch.float32).eval()
    print(f"transformers: loaded in {time.perf_counter() - t0:.1f} s")
    ref, ref_s = run_transformers(hf, inputs, targets, n_seq)
    print(line("transformers (f32)", ref, ref_s))

    gap = kv.ppl / ref.ppl - 1
    print(f"relative gap kvcli/transformers - 1 = {100 * gap:+.4f} %  ({'within' if abs(gap) <= 1e-3 else 'OUTSIDE'} 0.1%)")

    if not args.no_hf_tokenizer:
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        hft = AutoTokenizer.from_pretrained(args.model.parent, gguf_file=args.model.name)
        hf_ids = hft(text, add_special_tokens=False)["input_ids"]
        if bos is not None:
            hf_ids = [bos] + hf_ids
        print(f"transformers tokenizer: {len(hf_ids)} tokens in {time.perf_counter() - t0:.1f} s")
        n = args.chunks * args.ctx_size if args.chunks > 0 else len(tokens)
        diff = next((i for i, (a, b) in enumerate(zip(tokens[:n], hf_ids[:n])) if a != b), None)
        if diff is None and len(hf_ids) >= min(n, len(tokens)):
            print(f"tokenizers agree on the {min(n, len(tokens))} evaluated tokens")
        else:
            print(f"tokenizers differ first at token {diff}: kvcli {tokens[diff:diff + 8]} vs transformers "
                  f"{hf_ids[diff:diff + 8]}")
            h_in, h_tg = make_chunks(hf_ids, args.ctx_size, args.chunks, bos)
            ref2, ref2_s = run_transformers(hf, h_in, h_tg, n_seq)
            print(line("transformers on its own ids", ref2, ref2_s))


if __name__ == "__main__":
    main()
