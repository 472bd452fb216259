"""kvcli perplexity: llama-perplexity's method on a tiny model, KL divergence, the sweep, the CLI."""

import json
import math
import random
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from kvcli.commands.perplexity import perplexity_command
from kvcli.kld import kld_terms
from kvcli.logprob_base import dequantize_log_probs, quantize_log_probs
from kvcli.perplexity import first_scored, make_chunks, n_scored
from tiny import make_hf_model, write_gguf

N_CTX = 16
WORDS = "the cat sat on a mat while dogs ran far and the birds sang of rain in old towns".split()


def synthetic_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + ".\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl")
    hf = make_hf_model(n_heads=4, n_kv_heads=2, seed=3)
    with torch.no_grad():  # peaked distributions (a random init is near uniform) so divergences show
        hf.lm_head.weight.mul_(6)
    path = write_gguf(hf, d / "tiny.gguf")
    text = d / "text.txt"
    text.write_text(synthetic_text(70))
    return hf, path, text, d


@pytest.fixture(scope="module")
def app():
    app = typer.Typer()
    app.callback()(lambda: None)  # keep `perplexity` a subcommand, as in kvcli.cli
    app.command("perplexity")(perplexity_command)
    return app


def invoke(app, *args):
    return CliRunner().invoke(app, ["perplexity", *map(str, args)])


def tokens_of(path, text_path):
    from kvcli.llama import Llama

    return Llama(path, ctx_size=N_CTX).tokenize(text_path.read_text())


def direct_nll(hf, tokens, n_ctx):
    """llama.cpp's loop written out: chunk c, positions n_ctx/2 .. n_ctx-2 predict the next token."""
    nll = []
    for c in range(len(tokens) // n_ctx):
        ids = tokens[c * n_ctx : (c + 1) * n_ctx]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        nll += [-logp[p, ids[p + 1]].item() for p in range(n_ctx // 2, n_ctx - 1)]
    return nll


def ppl_of(nll):
    n = len(nll)
    mean = sum(nll) / n
    var = sum(x * x for x in nll) / n - mean * mean
    return math.exp(mean), math.exp(mean) * math.sqrt(var / (n - 1))


def test_scored_positions_and_chunks():
    tokens = list(range(100, 150))  # 50 tokens: 3 chunks of 16
    inputs, targets = make_chunks(tokens, 16, bos_id=7)
    assert inputs.shape == (3, 16) and targets.shape == (3, 7)
    assert inputs[:, 0].tolist() == [7, 7, 7] and inputs[1, 1:].tolist() == tokens[17:32]
    assert targets[1].tolist() == tokens[16 + 9 : 32]  # predicted by positions 8..14
    assert (first_scored(512), n_scored(512), n_scored(17)) == (256, 255, 8)
    assert make_chunks(tokens, 16, n_chunks=2)[0].shape == (2, 16)
    assert make_chunks(tokens, 16)[0][:, 0].tolist() == [100, 116, 132]  # no BOS where the vocab adds none


def test_ppl_matches_direct_computation(tiny, app, tmp_path):
    hf, path, text, _ = tiny
    tokens = tokens_of(path, text)
    n_chunk = len(tokens) // N_CTX
    assert n_chunk >= 4
    nll = direct_nll(hf, tokens, N_CTX)
    assert len(nll) == n_chunk * (N_CTX // 2 - 1)
    ppl, err = ppl_of(nll)

    out = tmp_path / "r.json"
    # a chunk in one forward, and in four (its scored rows then come as the batches make them: chunk_logits' blocks)
    for batch in (N_CTX // 4, N_CTX):
        r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "-b", batch, "-ctk", "f32", "-ctv", "f32", "--json", out)
        assert r.exit_code == 0, r.output
        got = json.loads(out.read_text())
        assert got["count"] == len(nll) and got["n_chunk"] == n_chunk
        assert got["ppl"] == pytest.approx(ppl, rel=1e-5) and got["ppl_err"] == pytest.approx(err, rel=1e-4)
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout)
    assert float(m[1]) == pytest.approx(ppl, rel=1e-5) and float(m[2]) == pytest.approx(err, rel=1e-4)
    running = [float(v) for v in re.findall(r"\[\d+\]([\d.]+),", r.stdout)]
    per_chunk = N_CTX // 2 - 1
    want = [math.exp(sum(nll[: (i + 1) * per_chunk]) / ((i + 1) * per_chunk)) for i in range(n_chunk)]
    assert running == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_batched_chunks_equal_one_by_one(tiny, app, tmp_path):
    """Chunks run together as sequences give each the same bits as one at a time; -ub caps them."""
    _, path, text, _ = tiny
    res = []
    for args, n_seq in ((("-b", N_CTX), 1), (("-b", 3 * N_CTX), 3), (("-b", 3 * N_CTX, "-ub", 2 * N_CTX), 2)):
        out = tmp_path / "r.json"
        r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, *args, "--chunks", 5, "--json", out)
        assert r.exit_code == 0, r.output
        assert f"n_seq={n_seq}" in r.stderr
        res.append(json.loads(out.read_text()))
    assert res[0]["count"] == res[1]["count"] == 5 * 7
    assert res[0]["ppl"] == res[1]["ppl"] == res[2]["ppl"] and res[0]["ppl_err"] == res[1]["ppl_err"] == res[2]["ppl_err"]


def test_too_short_text_is_a_clear_error(tiny, app, tmp_path):
    _, path, _, _ = tiny
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat")
    r = invoke(app, "-m", path, "-f", short, "-c", N_CTX)
    assert r.exit_code == 1
    assert "needs at least 2*n_ctx = 32 tokens, got" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("args, words", [
    (["--chunks", "0"], ["--chunks", "not 0"]),
    (["--chunks", "-2"], ["--chunks", "-1 (all)", "not -2"]),
    (["--dtype", "f64"], ["--dtype", "bf16", "'f64'"]),
    (["-c", "-8"], ["-c/--ctx-size", "not -8"]),
    (["-c", "0"], ["-c/--ctx-size", "not 0"]),
    (["-b", "0"], ["-b/--batch-size", "not 0"]),
    (["-b", "-512"], ["-b/--batch-size", "not -512"]),
    (["-ub", "0"], ["-ub/--ubatch-size", "not 0"]),
])
def test_bad_numbers_refused_before_reading(app, tmp_path, args, words):
    """One line and exit 1 before the text is read or a model loaded: the file and the model named
    here do not exist, so any later check would complain of them instead."""
    from cli_checks import assert_clean_error

    r = invoke(app, "-m", tmp_path / "no.gguf", "-f", tmp_path / "no.txt", *args)
    assert_clean_error(r, *words)
    assert "tokenizing" not in r.stderr and "no.txt" not in r.stderr


def test_kld_formula_and_quantization():
    torch.manual_seed(0)
    logq = torch.log_softmax(torch.randn(5, 300), -1)
    logp = torch.log_softmax(torch.randn(5, 300), -1)  # within 16 nats: nothing below the floor
    t = kld_terms(logq, logp, torch.tensor([0, 1, 2, 3, 4]))
    want = (logp.exp() * (logp - logq)).sum(-1)
    assert t["kld"].float() == pytest.approx(want, abs=1e-5)
    scale, low, q = quantize_log_probs(logp)
    assert (dequantize_log_probs(scale, low, q) - logp).abs().max() <= scale.max() / 2 + 1e-6
    wide = torch.log_softmax(torch.linspace(0, 40, 300)[None], -1)  # 40 nats wide: bottom clipped at top - 16
    s, lo, _ = quantize_log_probs(wide)
    assert lo.item() == pytest.approx(wide.max().item() - 16, abs=1e-5)


def test_kld_against_own_base_is_zero(tiny, app, tmp_path):
    _, path, text, _ = tiny
    base = tmp_path / "base.kld"
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence-base", base)
    assert r.exit_code == 0, r.output
    base_ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", r.stdout)[1])
    assert base.stat().st_size > 0
    out = tmp_path / "k.json"
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence-base", base, "--kl-divergence",
               "--json", out)
    assert r.exit_code == 0, r.output
    k = json.loads(out.read_text())["kld"]
    assert abs(k["kld"]) < 1e-6 and k["same_top"] == 1.0 and k["ppl"] == pytest.approx(k["ppl_base"], rel=1e-6)
    assert k["ppl_base"] == pytest.approx(base_ppl, rel=1e-6)  # the base keeps each target's exact NLL
    for label in ("Mean PPL(Q)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean    KLD:", "99.9%   KLD:", "Median  KLD:",
                  " 0.1%   KLD:", "Minimum KLD:", "RMS Δp    :", "Same top p: 100.000"):
        assert label in r.stdout, label

    # a lossier cache type against the same base: a real, positive divergence
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "-ctk", "bf16", "-ctv", "bf16",
               "--kl-divergence-base", base, "--kl-divergence", "--json", out)
    assert r.exit_code == 0, r.output
    lossy = json.loads(out.read_text())["kld"]
    # the own-base figure is the floor: the base's log-probabilities are stored quantized (llama.cpp's uint16s);
    # bf16 K/V of this tiny model (head size 16: no block type fits) sit about 3x above it
    assert lossy["kld"] > 2 * abs(k["kld"])


def test_base_mismatch_is_a_clear_error(tiny, app, tmp_path):
    _, path, text, _ = tiny
    base = tmp_path / "base.kld"
    assert invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence-base", base).exit_code == 0
    r = invoke(app, "-m", path, "-f", text, "-c", 2 * N_CTX, "--kl-divergence-base", base, "--kl-divergence")
    assert r.exit_code == 1 and "computed with -c 16, this run uses -c 32" in r.stderr
    other = tmp_path / "other.txt"
    other.write_text(synthetic_text(70, seed=1))
    r = invoke(app, "-m", path, "-f", other, "-c", N_CTX, "--kl-divergence-base", base, "--kl-divergence")
    assert r.exit_code == 1 and "tokenizes differently" in r.stderr
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence-base", text, "--kl-divergence")
    assert r.exit_code == 1 and "not a kvcli KL-divergence base file" in r.stderr
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--kl-divergence")
    assert r.exit_code == 1 and "--kl-divergence-base" in r.stderr


def test_sweep_table_and_json(tiny, app, tmp_path):
    _, path, text, _ = tiny
    out = tmp_path / "sweep.json"
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--chunks", 6, "--sweep", "f16/f16,f32/f32,bf16", "--json", out)
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [(x["type_k"], x["type_v"]) for x in rows] == [("f16", "f16"), ("f32", "f32"), ("bf16", "bf16")]
    f16, f32, bf16 = rows
    assert f16["mean_kld"] == 0.0 and f16["same_top_pct"] == 100.0 and f16["delta_ppl_pct"] == 0.0
    assert [x["bits_per_element"] for x in rows] == [16.0, 32.0, 16.0]
    assert f32["cache_mib_32k"] == pytest.approx(2 * f16["cache_mib_32k"])
    assert bf16["mean_kld"] > abs(f32["mean_kld"])
    for word in ("bf16", "same top", "KLD"):
        assert word in r.stdout


def test_sweep_without_all_still_shows_the_base_row(tiny, app, tmp_path):
    """`--sweep bf16/bf16` is measured against f16/f16 (the cache flags' default): that base row is
    printed first (KLD 0), as `all` prints it among the others. (bf16: the tiny model's head size
    is too small for the block types.)"""
    _, path, text, _ = tiny
    out = tmp_path / "sweep.json"
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--chunks", 2, "--sweep", "bf16/bf16", "--json", out)
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [(x["type_k"], x["type_v"]) for x in rows] == [("f16", "f16"), ("bf16", "bf16")]
    assert rows[0]["mean_kld"] == 0.0 and rows[0]["delta_ppl_pct"] == 0.0
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("│")]  # the body rows
    assert len(table) == 2 and table[0].startswith("│ f16  │ f16  │") and table[1].startswith("│ bf16 │ bf16 │"), r.stdout
    assert "sweep of 2 cache types" in r.stderr
    # A base given with the cache flags is the base row too, and listed once.
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--chunks", 2, "-ctk", "f32", "-ctv", "f32",
               "--sweep", "bf16,f32", "--json", out)
    assert r.exit_code == 0, r.output
    assert [x["cache"] for x in json.loads(out.read_text())["rows"]] == ["bf16", "f32"]


def test_sweep_all_lists_every_cache_type():
    from kvcli.cache import STORAGE_TYPES
    from kvcli.cache import CacheSpec
    from kvcli.sweep import parse_sweep

    assert parse_sweep("all") == [CacheSpec("kv", t, t) for t in STORAGE_TYPES]
    assert parse_sweep("f32/f16,all")[0] == CacheSpec("kv", "f32", "f16")
    assert len(parse_sweep("f32/f16,all")) == len(STORAGE_TYPES) + 1
    assert parse_sweep("F16 / BF16, f16/bf16") == [CacheSpec("kv", "f16", "bf16")]
    assert parse_sweep("hidden:q8,hidden:q8_0") == [CacheSpec("hidden", type_h="q8_0")]
    assert parse_sweep("hidden:all") == [CacheSpec("hidden", type_h=t) for t in STORAGE_TYPES]


def test_sweep_hidden_state_caches(tiny, app, tmp_path):
    """The sweep builds every cache as a run does, so hidden-state caches can be swept, and be the base."""
    _, path, text, _ = tiny
    out = tmp_path / "sweep.json"
    common = ["-m", path, "-f", text, "-c", N_CTX, "--chunks", 4, "--dtype", "f32", "--json", out]
    r = invoke(app, *common, "-ctk", "f32", "-ctv", "f32", "--sweep", "f32,hidden:f32,hidden:q8_0")
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [(x["mode"], x["cache"]) for x in rows] == [("kv", "f32"), ("hidden", "hidden:f32"), ("hidden", "hidden:q8_0")]
    assert abs(rows[1]["mean_kld"]) < 1e-5  # K/V rebuilt from the f32 input: the f32 cache's logits (base rounded to 16 bits)
    assert rows[2]["mean_kld"] > abs(rows[1]["mean_kld"]) and "hidden" in r.stdout
    r = invoke(app, *common, "--cache-mode", "hidden", "-cth", "f32", "--sweep", "hidden:f32,f32/f32")
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["base_mode"] == "hidden" and abs(data["rows"][1]["mean_kld"]) < 1e-5


def test_sweep_unknown_type_and_plot(tiny, app, tmp_path):
    _, path, text, _ = tiny
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--sweep", "f16/f16,q9_9/f16")
    assert r.exit_code == 1 and "unknown cache type 'q9_9'" in r.stderr
    png = tmp_path / "kld.png"
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--chunks", 3, "--sweep", "f16,bf16", "--plot", png)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.exit_code == 1 and "--plot needs matplotlib" in r.stderr
    else:
        assert r.exit_code == 0, r.output
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_row_equals_kld_against_saved_base(tiny, app, tmp_path):
    """The in-memory sweep and a saved base + --kl-divergence run measure the same thing."""
    _, path, text, _ = tiny
    base, kld_json, sweep_json = tmp_path / "b.kld", tmp_path / "k.json", tmp_path / "s.json"
    common = ["-m", path, "-f", text, "-c", N_CTX, "--chunks", 6]
    assert invoke(app, *common, "--kl-divergence-base", base).exit_code == 0
    r = invoke(app, *common, "-ctk", "bf16", "-ctv", "bf16", "--kl-divergence-base", base, "--kl-divergence",
               "--json", kld_json)
    assert r.exit_code == 0, r.output
    assert invoke(app, *common, "--sweep", "bf16/bf16", "--json", sweep_json).exit_code == 0
    k, row = json.loads(kld_json.read_text())["kld"], json.loads(sweep_json.read_text())["rows"][-1]
    assert row["cache"] == "bf16"
    assert row["ppl"] == pytest.approx(k["ppl"], rel=1e-6)
    assert row["mean_kld"] == pytest.approx(k["kld"], rel=1e-4)
    assert row["same_top_pct"] == pytest.approx(100 * k["same_top"])


def test_ctrl_c_prints_the_estimate_so_far_and_leaves_no_base(tiny, app, tmp_path, monkeypatch):
    import kvcli.commands.perplexity as ppl_mod

    real = ppl_mod.chunk_logits

    def interrupted_after_two(*args, **kwargs):
        for i, logits in real(*args, **kwargs):
            if i == 2:
                raise KeyboardInterrupt
            yield i, logits

    monkeypatch.setattr(ppl_mod, "chunk_logits", interrupted_after_two)
    _, path, text, _ = tiny
    base = tmp_path / "base.kld"
    r = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "-b", N_CTX, "--kl-divergence-base", base)
    assert r.exit_code == 130, r.output
    assert "[2]" in r.stdout and "[3]" not in r.stdout and "Final estimate: PPL = " in r.stdout
    assert not base.exists() and not list(tmp_path.iterdir())


def test_hidden_cache_mode_f32_equals_kv_f32(tiny, app, tmp_path):
    _, path, text, _ = tiny
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r1 = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "-ctk", "f32", "-ctv", "f32", "--json", a)
    r2 = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--cache-mode", "hidden", "-cth", "f32", "--json", b)
    assert r1.exit_code == 0 and r2.exit_code == 0, r2.output
    assert json.loads(b.read_text())["ppl"] == pytest.approx(json.loads(a.read_text())["ppl"], rel=1e-5)
    r3 = invoke(app, "-m", path, "-f", text, "-c", N_CTX, "--cache-mode", "hidden", "-ctk", "q8_0")
    assert r3.exit_code == 1 and "-cth" in r3.stderr


def test_scoring_a_few_positions_at_a_time_changes_no_figure(tiny, app, tmp_path, monkeypatch):
    """Every printed figure, the base file's bytes and the sweep's rows are the same bits whether a
    chunk's log-softmax is taken 3 positions at a time or whole, and equal a plain full-logits
    computation; no log-softmax or dequantized base block is wider than 3 positions."""
    import kvcli.logprob_base as base_mod
    import kvcli.perplexity as method
    from kvcli.llama import Llama
    from kvcli.perplexity import PplStats, scored_log_probs, token_nll

    _, path, text, _ = tiny
    widest = {"log_softmax": 0, "from_records": 0}

    def spy(name, real):
        def wrapped(x, *args, **kwargs):
            widest[name] = max(widest[name], len(x))
            return real(x, *args, **kwargs)
        return wrapped

    def run_all(rows, tag):
        monkeypatch.setattr(method, "SCORE_ROWS", rows)
        d = tmp_path / tag
        d.mkdir()
        common = ("-m", path, "-f", text, "-c", N_CTX, "-b", 2 * N_CTX)  # 2 chunks per forward
        plain = invoke(app, *common, "--kl-divergence-base", d / "base.kld", "--json", d / "plain.json")
        kld = invoke(app, *common, "--kl-divergence-base", d / "base.kld", "--kl-divergence", "-ctk", "bf16",
                     "-ctv", "bf16", "--json", d / "kld.json")
        sweep = invoke(app, *common, "--sweep", "bf16,f32,hidden:q8_0", "--json", d / "sweep.json")
        for r in (plain, kld, sweep):
            assert r.exit_code == 0, r.output
        rows_json = [{k: v for k, v in row.items() if k != "seconds"}
                     for row in json.loads((d / "sweep.json").read_text())["rows"]]
        drop = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k != "seconds"}  # noqa: E731
        return (plain.stdout, kld.stdout, (d / "base.kld").read_bytes(), drop(d / "plain.json"), drop(d / "kld.json"),
                rows_json)

    whole = run_all(10**6, "whole")  # one block per chunk: the unbatched scoring
    monkeypatch.setattr(torch, "log_softmax", spy("log_softmax", torch.log_softmax))
    monkeypatch.setattr(base_mod, "from_records", spy("from_records", base_mod.from_records))
    blocks = run_all(3, "blocks")
    assert 0 < widest["log_softmax"] <= 3 and 0 < widest["from_records"] <= 3
    assert blocks[0] == whole[0] and blocks[1] == whole[1]  # stdout: PPL, running values, KLD report
    assert blocks[2] == whole[2]  # the base file, byte for byte
    assert blocks[3:] == whole[3:]  # JSON figures, timings aside

    # the straightforward way: every chunk's full logits, log-softmax of the scored half at once
    monkeypatch.undo()
    llm = Llama(path, ctx_size=N_CTX, dtype="f32", batch_size=N_CTX, n_seq=2)
    tokens = llm.tokenize(text.read_text())
    inputs, targets = make_chunks(tokens, N_CTX, bos_id=llm.tokenizer.bos_id if llm.tokenizer.add_bos else None)
    stats = PplStats()
    for i in range(0, len(inputs), 2):
        lp = scored_log_probs(llm.logits(inputs[i : i + 2]), N_CTX)  # (B, n_scored, V)
        for b in range(len(lp)):
            stats.add(token_nll(lp[b], targets[i + b]))
    assert blocks[3]["ppl"] == stats.ppl and blocks[3]["count"] == stats.count
