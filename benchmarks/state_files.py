"""State files and the RAM prompt cache per cache type (issue 43): a WikiText prompt of N tokens prefilled, the
sequence saved to a state file (kvcli/cache/state.py) and restored into the same cache; one run, times as ratios.
Printed per type and length: prefill s, save s, restore s, prefill / restore, file MiB, the cache's bytes for those
positions, and how many N-token prefixes `kvcli serve --cache-ram 512` holds (512 MiB over an entry's bytes).
The restore reads a file just written (the page cache): a cold disk adds its read time.

    python benchmarks/state_files.py [--model M] [--lengths 4096,16384] [--types f16,q8_0,q4_hadamard,tq3] [-t 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.cache import state  # noqa: E402
from kvcli.llama import Llama  # noqa: E402

MIB = 1024 * 1024
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
RAM = 512 * MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--types", default="f16,q8_0,q4_hadamard,tq3")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"{'type':12} {'tokens':>6} {'prefill s':>9} {'save s':>7} {'restore s':>9} {'prefill/restore':>15} "
          f"{'file MiB':>9} {'in use MiB':>10} {'f16 file x':>10} {'prefixes in 512 MiB':>19}")
    f16_bytes = {}
    with tempfile.TemporaryDirectory() as folder:
        for n in lengths:
            for t in args.types.split(","):
                llm = Llama(*([args.model] if args.model else []), ctx_size=n, cache_type_k=t, cache_type_v=t,
                            threads=args.threads)
                ids = llm.tokenize(WIKI.read_text(encoding="utf-8")[: 8 * n])[:n]
                assert len(ids) == n, f"WikiText gave {len(ids)} tokens, {n} asked for"
                t0 = time.perf_counter()
                llm.eval(ids)
                prefill = time.perf_counter() - t0
                path = Path(folder) / f"{t}-{n}.kvs"
                t0 = time.perf_counter()
                size = llm.save_state(path)
                save = time.perf_counter() - t0
                in_use = sum(p.tensor.numel() * p.tensor.element_size() for p in state.parts(llm.cache, 0, n))
                llm.reset()
                t0 = time.perf_counter()
                llm.load_state(path)
                restore = time.perf_counter() - t0
                f16_bytes.setdefault(n, size if t == "f16" else None)
                ratio = f"{size / f16_bytes[n]:.3f}" if f16_bytes[n] else "-"
                print(f"{t:12} {n:6d} {prefill:9.2f} {save:7.3f} {restore:9.3f} {prefill / restore:15.0f} "
                      f"{size / MIB:9.2f} {in_use / MIB:10.2f} {ratio:>10} {RAM // in_use:19d}", flush=True)
                path.unlink()
                del llm


if __name__ == "__main__":
    main()
