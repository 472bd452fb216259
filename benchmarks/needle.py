"""Passkey retrieval (issue 41): a pass key placed at 10%-90% depth of a WikiText haystack of N tokens, greedy, one
run per cache type; success per type against f16's, as a table (and a plot with --plot).

    python benchmarks/needle.py -m qwen2.5-coder-0.5b --lengths 4096,8192,16384,32768 --caches f16,tq4,tq3
    python benchmarks/needle.py --lengths 4096,8192 --caches f16,q4_hadamard,tq4,tq3      # SmolLM2, to its 8k

The prompt is llama.cpp's passkey example's (examples/passkey): an instruction, the haystack with the key
sentence inside, the question, and "The pass key is" for the model to complete; WikiText (test split) replaces its
repeated filler so that the haystack reads as text. A run passes where the key's digits are the first digits of
its greedy continuation. Each (length, depth) has its own key, the same for every cache type.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8  # generated after the prompt: prompt and answer fill N tokens, the context of an N-token run


def prompt_ids(llm, haystack: list[int], length: int, depth: float, key: int) -> list[int]:
    """INTRO + haystack tokens with the key sentence at `depth` of them + QUESTION: `length` tokens in all with the
    answer's ANSWER_TOKENS, so a run of N tokens fits an N-token context (a prompt of N would leave no room)."""
    intro, question = llm.tokenize(INTRO), llm.tokenize(QUESTION, add_bos=False)
    needle = llm.tokenize(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_bos=False)
    n_hay = length - ANSWER_TOKENS - len(intro) - len(question) - len(needle)
    if n_hay > len(haystack):
        raise SystemExit(f"error: the haystack text holds {len(haystack)} tokens, {n_hay} asked for")
    at = int(n_hay * depth)
    return intro + haystack[:at] + needle + haystack[at:n_hay] + question


def answer(llm, ids: list[int], n: int = ANSWER_TOKENS) -> str:
    from kvcli.sampler import Sampler

    llm.reset()
    return llm.detokenize(list(llm.generate(ids, n_predict=n, sampler=Sampler(temp=0), stop_at_eog=False)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a GGUF file or a `kvcli pull` name (default: SmolLM2)")
    ap.add_argument("--lengths", default="4096,8192", help="run lengths in tokens: prompt and answer, the context")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="where the key sits, as fractions of the haystack")
    ap.add_argument("--caches", default="f16,tq4,tq3", help="K=V cache types (or K/V pairs), comma-separated")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", type=Path, default=None, help="a PNG: success per length for each cache type")
    args = ap.parse_args()
    if not WIKITEXT.is_file():
        sys.exit(f"error: {WIKITEXT} is missing (the WikiText-2 test text)")
    from kvcli.commands.common import resolve_model
    from kvcli.llama import Llama

    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    rng = random.Random(args.seed)
    keys = {(n, d): rng.randrange(10000, 100000) for n in lengths for d in depths}
    path = resolve_model(Path(args.model) if args.model else None)
    found: dict[str, dict[tuple[int, float], bool]] = {}
    for cache in caches:
        k, _, v = cache.partition("/")
        llm = Llama(path, ctx_size=max(lengths), cache_type_k=k, cache_type_v=v or k, threads=args.threads,
                    log=lambda line: print(line, file=sys.stderr))
        haystack = llm.tokenize(WIKITEXT.read_text()[: 8 * max(lengths)], add_bos=False)
        found[cache] = {}
        for n in lengths:
            for d in depths:
                t0 = time.perf_counter()
                text = answer(llm, prompt_ids(llm, haystack, n, d, keys[n, d]))
                digits = re.sub(r"\D", "", text)
                found[cache][n, d] = digits.startswith(str(keys[n, d]))
                print(f"{cache:10s} {n:6d} tokens, depth {d:.1f}: {'found' if found[cache][n, d] else 'MISSED'} "
                      f"({text.strip()!r}, {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        del llm
    print(f"\npasskey found, {path.name}, depths {args.depths} (found / tried; where f16 found it)\n")
    print("| cache | " + " | ".join(f"{n:,}" for n in lengths) + " | where f16 found it |")
    print("| --- | " + " | ".join("---:" for _ in lengths) + " | ---: |")
    base = found.get("f16")
    for cache, hits in found.items():
        cells = [f"{sum(hits[n, d] for d in depths)}/{len(depths)}" for n in lengths]
        agree = "-" if base is None else f"{sum(hits[x] for x in base if base[x])}/{sum(base.values())}"
        print(f"| {cache} | " + " | ".join(cells) + f" | {agree} |")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            sys.exit("error: --plot needs matplotlib (pip install matplotlib)")

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for cache, hits in found.items():
            ax.plot(lengths, [sum(hits[n, d] for d in depths) / len(depths) for n in lengths], marker="o", label=cache)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("passkey found (share of depths)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend()
        ax.set_title(path.name)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
