"""Pipeline stages (issue 44, kvcli/pipeline.py) on one machine: a model over 1 and 2 processes (gloo on 127.0.0.1,
`-t 1` each, started as torchrun starts them). Per stage count: prompt t/s (a WikiText prompt of --prompt tokens),
decode t/s (--n tokens after it), bytes rank 0 and the others sent a decoded token, each rank's peak RSS.

    python benchmarks/pipeline.py [--model M] [--stages 1,2] [--prompt 512] [--n 64] [-ctk f16 -ctv f16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from serve import free_port  # benchmarks/serve.py (this folder is the script's path)

ROOT = Path(__file__).resolve().parents[1]
WIKI = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

RANK = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
from kvcli.cache import CacheSpec
from kvcli.llama import Llama
from kvcli.pipeline import start
spec = CacheSpec("kv", {ctk!r}, {ctv!r})
stages, log = start({model!r}, None, spec, {ctx}, "f16", "native", "cpu")
llm = Llama({model!r}, ctx_size={ctx}, threads=1, cache_type_k={ctk!r}, cache_type_v={ctv!r}, pipeline=stages)
stage, pipe = stages
out = {{"rank": stage.rank, "layers": f"{{stage.layers.start}}-{{stage.layers.stop - 1}}"}}
if stage.first:
    ids = llm.tokenize(open({wiki!r}, encoding="utf-8").read()[: 8 * {prompt}])[: {prompt}]
    t0 = time.perf_counter(); logits = llm.eval(ids); pp = time.perf_counter() - t0
    sent0 = pipe.sent_bytes
    t0 = time.perf_counter()
    for _ in range({n}):
        logits = llm.eval([int(logits.argmax())])
    tg = time.perf_counter() - t0
    out |= {{"pp": len(ids) / pp, "tg": {n} / tg, "sent_per_token": (pipe.sent_bytes - sent0) / {n}}}
    pipe.stop()
else:
    pipe.serve()
    out["sent_total"] = pipe.sent_bytes
out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out["weights_mib"] = llm.model.weight_bytes() / 2**20
out["cache_mib"] = llm.cache.nbytes() / 2**20
print("RESULT " + json.dumps(out), flush=True)
pipe.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-ctv", default="f16")
    args = ap.parse_args()
    code = RANK.format(root=str(ROOT), model=args.model, ctk=args.ctk, ctv=args.ctv, ctx=args.ctx, wiki=str(WIKI),
                       prompt=args.prompt, n=args.n)
    print(f"{Path(args.model).name}, -ctk {args.ctk} -ctv {args.ctv}, prompt {args.prompt}, decode {args.n}, -t 1 "
          f"a rank")
    for n in [int(x) for x in args.stages.split(",")]:
        port = str(free_port())
        with tempfile.TemporaryDirectory():
            procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(n),
                                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                     for r in range(n)]
            results = []
            for p in procs:
                out, err = p.communicate(timeout=3600)
                lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
                if p.returncode or not lines:
                    sys.exit(f"a rank failed:\n{err[-3000:]}")
                results.append(json.loads(lines[0][7:]))
        r0 = results[0]
        print(f"{n} stage(s): pp {r0['pp']:.1f} t/s, tg {r0['tg']:.1f} t/s, rank 0 sent {r0['sent_per_token']:.0f} B "
              f"a decoded token")
        for r in results:
            print(f"  rank {r['rank']} (layers {r['layers']}): peak RSS {r['rss_mib']:.0f} MiB, weights "
                  f"{r['weights_mib']:.1f} MiB, cache {r['cache_mib']:.1f} MiB"
                  + (f", sent {r['sent_total'] / (args.prompt + args.n):.0f} B a token" if "sent_total" in r else ""))


if __name__ == "__main__":
    main()
