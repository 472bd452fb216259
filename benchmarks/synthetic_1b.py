"""kvcli beside llama.cpp on a synthetic Llama-3.2-1B-shaped GGUF (random weights; issue 15).

    LLAMA_BIN=/path/to/llama.cpp/build/bin python3 benchmarks/synthetic_1b.py [--dir DIR] [-t 2] [-n 128]

Writes, into DIR (default /tmp/kvcli-synthetic-1b; never into the repository), an f16 file of
Llama-3.2-1B's shape with random weights, one tensor at a time, then `llama-quantize`s it to each
of --types (Q4_0, Q4_K_M), as a downloaded file is made: llama-quantize keeps the tied
token_embd at Q6_K in both. Files already in DIR are reused; --delete removes DIR at the end.
Then, per file: the tensor bytes in the file; a 16-token `kvcli run` and `llama-completion`
under /usr/bin/time -v (peak RSS; kvcli's resident weight MiB and load seconds from its model
line, llama.cpp's load time and CPU buffer from its log); tgN from `kvcli bench -p 0` and
`llama-bench -p 0 -fa 1`, both at -t T.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvcli.bpe import bytes_to_unicode

MIB = 1 << 20
PROMPT = "The history of the city begins in the early middle ages, when"
# Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B)
LAYERS, N_EMBD, N_FF, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 16, 2048, 8192, 32, 8, 64, 128256
ROPE_BASE, RMS_EPS, CONTEXT = 500000.0, 1e-5, 131072
N_SPECIAL = 256  # <|begin_of_text|> = 128000 ... as Llama 3's reserved special tokens
STD = 0.02  # initializer_range: activations stay O(1) through 16 random layers
ROWS = 8192  # rows drawn at a time (8192 x 8192 f32: 256 MiB)


def vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges): a gpt2-style vocab of VOCAB tokens. The 256 byte symbols, then
    pairs and triples of them (each with its merge, so every token is reachable), then Llama 3's
    special tokens (control)."""
    chars = list(bytes_to_unicode().values())  # GPT-2's byte symbols, in its order
    tokens, merges = list(chars), []
    for a in chars:
        for b in chars:
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    triples = ((ab, c) for ab in tokens[256:] for c in chars)
    for ab, c in itertools.islice(triples, VOCAB - N_SPECIAL - len(tokens)):
        tokens.append(ab + c)
        merges.append(f"{ab} {c}")
    special = [f"<|reserved_special_token_{i}|>" for i in range(N_SPECIAL)]
    special[:2], special[9] = ["<|begin_of_text|>", "<|end_of_text|>"], "<|eot_id|>"
    return tokens + special, [1] * (VOCAB - N_SPECIAL) + [3] * N_SPECIAL, merges


def tensor_plan() -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, numpy shape (rows, cols)) in llama.cpp's file order; tied head: no output.weight."""
    plan = [("token_embd.weight", (VOCAB, N_EMBD))]
    for i in range(LAYERS):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (N_EMBD,)), (p + "ffn_down.weight", (N_EMBD, N_FF)),
                 (p + "ffn_gate.weight", (N_FF, N_EMBD)), (p + "ffn_up.weight", (N_FF, N_EMBD)),
                 (p + "ffn_norm.weight", (N_EMBD,)), (p + "attn_k.weight", (KV_HEADS * HEAD_DIM, N_EMBD)),
                 (p + "attn_output.weight", (N_EMBD, HEADS * HEAD_DIM)),
                 (p + "attn_q.weight", (HEADS * HEAD_DIM, N_EMBD)),
                 (p + "attn_v.weight", (KV_HEADS * HEAD_DIM, N_EMBD))]
    return plan + [("output_norm.weight", (N_EMBD,))]


def write_f16(path: Path, seed: int) -> None:
    """The f16 base file, one tensor in memory at a time (the largest, token_embd, 501 MiB f16);
    norms f32 and 1 + N(0, 0.02), matrices N(0, 0.02)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, types, merges = vocab()
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("Llama-3.2-1B synthetic (random weights)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(VOCAB - N_SPECIAL)
    w.add_eos_token_id(VOCAB - N_SPECIAL + 1)
    w.add_add_bos_token(True)
    plan = tensor_plan()
    for name, shape in plan:
        dt = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in plan:
        if len(shape) == 1:
            w.write_tensor_data((1 + STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32))
            continue
        t = np.empty(shape, np.float16)
        for r in range(0, shape[0], ROWS):
            n = min(ROWS, shape[0] - r)
            t[r : r + n] = STD * rng.standard_normal((n, shape[1]), dtype=np.float32)
        w.write_tensor_data(t)
        del t
    w.close()
    tmp.rename(path)


def quantize(bin_dir: Path, base: Path, out: Path, qtype: str, threads: int) -> None:
    tmp = out.with_suffix(".tmp")
    sh([str(bin_dir / "llama-quantize"), str(base), str(tmp), qtype, str(threads)])
    tmp.rename(out)


def file_tensors(path: Path) -> tuple[int, str]:
    """(tensor bytes in the file, 'count x type, ...')."""
    import gguf

    r = gguf.GGUFReader(str(path))
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return sum(int(t.n_bytes) for t in r.tensors), ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))


def sh(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """cmd with stdin from /dev/null, its output captured; a failure ends the script with its stderr.
    errors="replace": random weights generate bytes that are not UTF-8."""
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r


def timed(cmd: list[str]) -> tuple[float, str]:
    """(peak RSS MiB, stderr + stdout) of cmd under /usr/bin/time -v."""
    r = sh(["/usr/bin/time", "-v", *cmd])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024
    return rss, r.stderr + r.stdout


def kvcli_run(model: Path, threads: int) -> dict:
    """Peak RSS of a 16-token greedy run; resident weight MiB and load s from kvcli's model line."""
    rss, log = timed(["kvcli", "run", "-m", str(model), "-p", PROMPT, "-n", "16", "-c", "4096", "--temp", "0",
                      "-t", str(threads), "-no-cnv"])
    m = re.search(r"(\w+) weights ([\d.]+) MiB, loaded in ([\d.]+) s", log)
    return {"rss": rss, "resident": float(m.group(2)), "load": float(m.group(3)), "line": m.group(0)}


def llama_run(bin_dir: Path, model: Path, threads: int) -> dict:
    """Peak RSS of a 16-token greedy run; load time and CPU weight buffer from llama.cpp's log."""
    rss, log = timed([str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", "16", "-c", "4096",
                      "--temp", "0", "-t", str(threads), "-fa", "on", "-no-cnv", "-lv", "4"])  # -lv 4: the buffer lines
    load = re.search(r"load time\s*=\s*([\d.]+) ms", log)
    # CPU_Mapped: the file's pages; CPU_REPACK: copies of the tensors it interleaves for its AVX2 kernels
    bufs = dict(re.findall(r"(CPU\w*) model buffer size\s*=\s*([\d.]+) MiB", log))
    return {"rss": rss, "load": float(load.group(1)) / 1000, "buffers": {k: float(v) for k, v in bufs.items()}}


def kvcli_info(model: Path) -> str:
    """`kvcli info`'s weights line and its table of resident forms per tensor type."""
    out = sh(["kvcli", "info", str(model)], env=dict(os.environ, COLUMNS="160")).stdout
    return out.split("cache bytes per token")[0].split("\n", 2)[2].rstrip()


def kvcli_tg(model: Path, threads: int, n: int, reps: int) -> float:
    out = sh(["kvcli", "bench", "-m", str(model), "-p", "0", "-n", str(n), "-t", str(threads), "-r", str(reps),
              "-o", "csv"])
    return float(next(csv.DictReader(io.StringIO(out.stdout)))["tokens_per_s"])


def llama_tg(bin_dir: Path, model: Path, threads: int, n: int, reps: int) -> float:
    out = sh([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n), "-t", str(threads), "-fa", "1",
              "-r", str(reps), "-o", "json"])
    return json.loads(out.stdout)[0]["avg_ts"]


def machine() -> str:
    model = re.search(r"Model name:\s*(.+)", sh(["lscpu"]).stdout)
    flags = open("/proc/cpuinfo").read()
    simd = [f for f in ("avx2", "avx512f") if f" {f} " in flags]
    return f"{model.group(1).strip() if model else '?'}, {os.cpu_count()} cores, {'/'.join(simd) or 'no AVX2'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvcli-synthetic-1b"), help="where the files go")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama-quantize types")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128, help="tokens generated by each bench (tgN)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="bench repetitions, both tools")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delete", action="store_true", help="remove --dir at the end")
    args = ap.parse_args()
    bin_dir = Path(os.environ.get("LLAMA_BIN", ""))
    if not (bin_dir / "llama-quantize").exists():
        raise SystemExit("set LLAMA_BIN to llama.cpp's build/bin (llama-bench, llama-completion, llama-quantize)")
    if shutil.which("kvcli") is None:
        raise SystemExit("kvcli is not on PATH (activate the environment it is installed in)")

    args.dir.mkdir(parents=True, exist_ok=True)
    base = args.dir / "llama-3.2-1b-synthetic.F16.gguf"
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {machine()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    if not base.exists():
        t0 = time.perf_counter()
        write_f16(base, args.seed)
        print(f"wrote {base} in {time.perf_counter() - t0:.0f} s", flush=True)
    files = []
    for qtype in args.types.split(","):
        out = args.dir / f"llama-3.2-1b-synthetic.{qtype}.gguf"
        if not out.exists():
            t0 = time.perf_counter()
            quantize(bin_dir, base, out, qtype, args.threads)
            print(f"wrote {out} in {time.perf_counter() - t0:.0f} s", flush=True)
        files.append((qtype, out))

    rows = []
    for qtype, path in files:
        nbytes, types = file_tensors(path)
        print(f"\n{path.name}: {types}; {nbytes / MIB:.1f} MiB of tensors", flush=True)
        print(kvcli_info(path), flush=True)
        k, ll = kvcli_run(path, args.threads), llama_run(bin_dir, path, args.threads)
        bufs = ", ".join(f"{name} {mib:.1f} MiB" for name, mib in ll["buffers"].items())
        print(f"kvcli run: {k['line']}, peak RSS {k['rss']:.0f} MiB\nllama-completion: {bufs}, "
              f"load {ll['load']:.2f} s, peak RSS {ll['rss']:.0f} MiB", flush=True)
        k_tg, l_tg = kvcli_tg(path, args.threads, args.n, args.reps), llama_tg(bin_dir, path, args.threads, args.n,
                                                                              args.reps)
        print(f"tg{args.n}: kvcli {k_tg:.2f} t/s, llama.cpp {l_tg:.2f} t/s, load average {os.getloadavg()[0]:.2f}",
              flush=True)
        rows.append((qtype, nbytes / MIB, k, ll, k_tg, l_tg))

    print(f"\n| file | kvcli resident MiB | file tensor MiB | load s kvcli / llama.cpp | tg{args.n} t/s kvcli / "
          f"llama.cpp | ratio | peak RSS MiB kvcli / llama.cpp |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for qtype, mib, k, ll, k_tg, l_tg in rows:
        print(f"| {qtype} | {k['resident']:.1f} | {mib:.1f} | {k['load']:.2f} / {ll['load']:.2f} | {k_tg:.2f} / "
              f"{l_tg:.2f} | {k_tg / l_tg:.2f}x | {k['rss']:.0f} / {ll['rss']:.0f} |")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.delete:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    sys.exit(main())
