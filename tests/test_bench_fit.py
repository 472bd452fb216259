"""`kvcli bench` argument combinations and `kvcli fit`'s arithmetic against the byte formulas."""

import json

import pytest

from kvcli.bench import combinations, run_bench, to_csv, to_json, to_markdown
from kvcli.config import ModelConfig
from kvcli.errors import KvcliError
from kvcli.cache import CacheSpec
from kvcli.fit import cache_bytes, choices, fit_table, parse_bytes
from kvcli.memory import largest_context
from kvcli.memory import WORKING_BYTES

SMOL = ModelConfig(arch="llama", n_layers=30, n_embd=576, n_ff=1536, n_heads=9, n_kv_heads=3, head_dim=64,
                   vocab_size=49152, context_length=8192, rms_eps=1e-5, rope_base=1e5)


def test_combinations_do_not_repeat():
    combos = combinations(["kv", "hidden"], ["f16", "q8_0"], ["f16"], ["f16", "q4_0"], ["on", "off"])
    assert len(combos) == len(set(combos)) == 2 * 2 + 2 * 2
    assert ("hidden", "-", "-", "q4_0", "off") in combos and ("kv", "q8_0", "f16", "-", "on") in combos


@pytest.mark.parametrize("text,value", [("8GiB", 8 * 2**30), ("8G", 8 * 2**30), ("8GB", 8 * 10**9),
                                        ("512MiB", 512 * 2**20), ("1.5g", int(1.5 * 2**30)), ("1000", 1000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_nonsense():
    for bad in ("", "lots", "8XB", "-1G", "0", "0GiB", "0.0000001", "nan", "inf", "1e400", "1e30GiB"):
        with pytest.raises(KvcliError):
            parse_bytes(bad)


def test_cache_bytes_follow_the_formula():
    L, kv, E = SMOL.n_layers, SMOL.kv_dim, SMOL.n_embd
    assert cache_bytes(SMOL, CacheSpec("kv", "f16", "f16"), 4096) == 2 * L * 4096 * kv * 2
    assert cache_bytes(SMOL, CacheSpec("kv", "q4_0", "q8_0"), 4096) == L * 4096 * kv * (18 + 34) // 32
    assert cache_bytes(SMOL, CacheSpec("hidden", type_h="q8_0"), 4096) == L * 4096 * E * 34 // 32


@pytest.mark.parametrize("choice", choices(), ids=lambda c: c.label)
def test_largest_context_is_exact(choice):
    room = 3 * 2**30 + 12345
    n = largest_context(SMOL, choice, room)
    assert cache_bytes(SMOL, choice, n) <= room < cache_bytes(SMOL, choice, n + 1)


def test_fit_recommends_most_faithful_that_reaches(tmp_path):
    weights = 270 * 2**20
    mem = weights + WORKING_BYTES + cache_bytes(SMOL, CacheSpec("kv", "q8_0", "q8_0"), 65536)
    sweep = {CacheSpec("kv", t, t): kld for t, kld in [("f16", 0.0), ("q8_0", 0.0005), ("q4_0", 0.14),
                                                         ("q4_hadamard", 0.018)]}
    rows, best = fit_table(SMOL, weights, mem, 65536, sweep)
    assert best["choice"] == "kv q8_0/q8_0"  # f16 does not reach 64k here; q8_0 just does
    by = {r["choice"]: r for r in rows}
    assert by["kv f16/f16"]["max_ctx"] < 65536 <= by["kv q8_0/q8_0"]["max_ctx"]
    rows, best = fit_table(SMOL, weights, mem, 10**7, sweep)
    assert best is None


def _reaching(choice, n):
    """A budget whose cache room holds exactly n tokens of `choice` (weights 270 MiB)."""
    return 270 * 2**20 + WORKING_BYTES + cache_bytes(SMOL, choice, n)


def test_fit_never_recommends_f32_over_the_f16_reference():
    rows, best = fit_table(SMOL, 270 * 2**20, 2 * 2**30, 8192, {})
    assert best["choice"] == "kv f16/f16" and {r["choice"] for r in rows if r["max_ctx"] >= 8192} > {"kv f32/f32"}
    # a sweep against an f32 base gives f32 KLD 0 and f16 a little more: f16 is still the pick
    rows, best = fit_table(SMOL, 270 * 2**20, 2 * 2**30, 8192, {CacheSpec("kv", "f32", "f32"): 0.0,
                                                                 CacheSpec("kv", "f16", "f16"): 1e-6})
    assert best["choice"] == "kv f16/f16"


def test_fit_without_sweep_ranks_by_the_least_precise_part():
    """q4_hadamard/f16 has more bits on average (10.25) than q8_0/q8_0 (8.5), but 4.5-bit keys."""
    mem = _reaching(CacheSpec("kv", "q8_0", "q8_0"), 65536)
    _, best = fit_table(SMOL, 270 * 2**20, mem, 65536, {})
    assert best["choice"] == "kv q8_0/q8_0"
    _, best = fit_table(SMOL, 270 * 2**20, _reaching(CacheSpec("kv", "q5_1", "q5_1"), 65536), 65536, {})
    assert best["choice"] == "kv q5_1/q5_1"


def test_fit_ranks_measured_choices_before_unmeasured_ones():
    mem = _reaching(CacheSpec("kv", "q8_0", "q8_0"), 65536)  # q8_0, q5_x, q4_x reach; f16 does not
    sweep = {CacheSpec("kv", "q4_hadamard", "q4_hadamard"): 0.018, CacheSpec("kv", "q4_0", "q4_0"): 0.14}
    _, best = fit_table(SMOL, 270 * 2**20, mem, 65536, sweep)
    assert best["choice"] == "kv q4_hadamard/q4_hadamard" and best["kld"] == 0.018
    sweep[CacheSpec("kv", "f16", "f16")] = 0.0  # measured, but out of reach
    sweep[CacheSpec("hidden", type_h="q4_0")] = 0.001
    _, best = fit_table(SMOL, 270 * 2**20, mem, 65536, sweep)
    assert best["choice"] == "hidden q4_0"


def test_load_sweep_reads_kv_and_hidden_rows(tmp_path):
    from kvcli.fit import load_sweep

    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"rows": [{"mode": "kv", "type_k": "q8_0", "type_v": "q4_0", "type_h": None, "mean_kld": 0.1},
                                      {"mode": "hidden", "type_k": None, "type_v": None, "type_h": "q8_0", "mean_kld": 0.2},
                                      {"type_k": "f16", "type_v": "f16", "mean_kld": 0.0}]}))  # a row without mode
    assert load_sweep(p) == {CacheSpec("kv", "q8_0", "q4_0"): 0.1, CacheSpec("hidden", type_h="q8_0"): 0.2,
                             CacheSpec("kv", "f16", "f16"): 0.0}


def test_load_sweep_counts_its_base_as_kld_zero_and_refuses_junk(tmp_path):
    from kvcli.fit import load_sweep

    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"base_mode": "kv", "base_type_k": "q8_0", "base_type_v": "q8_0", "base_type_h": "f16",
                             "rows": [{"mode": "kv", "type_k": "q4_0", "type_v": "q4_0", "mean_kld": 0.1}]}))
    assert load_sweep(p) == {CacheSpec("kv", "q4_0", "q4_0"): 0.1, CacheSpec("kv", "q8_0", "q8_0"): 0.0}
    for junk, word in [({"a": 1}, "no sweep rows"), ([1, 2], "no sweep rows"), ("text", "no sweep rows"),
                       ([{"type_k": "q4_0", "type_v": "q4_0", "mean_kld": "big"}], "not a number"),
                       ([{"type_k": "q9", "type_v": "q4_0", "mean_kld": 0.1}], "unknown cache type")]:
        p.write_text(json.dumps(junk))
        with pytest.raises(KvcliError, match=word):
            load_sweep(p)


def test_bench_rows_and_formats(tmp_path):
    from kvcli.llama import Llama
    from tiny import make_hf_model, write_gguf

    path = write_gguf(make_hf_model(n_heads=2, n_kv_heads=1, hidden=64), tmp_path / "t.gguf")

    def make(ctx, mode, tk, tv, th, fa):
        return Llama(path, ctx_size=ctx, dtype="f32", cache_type_k=tk, cache_type_v=tv, flash_attn=fa)

    combos = combinations(["kv"], ["f16", "f32"], ["f16"], ["f16"], ["on"])
    rows = run_bench(make, "t.gguf", [("pp", 8), ("tg", 4)], [0, 16], combos, reps=2, threads=1, backend="CPU")
    assert [r.test for r in rows[:4]] == ["pp8", "tg4", "pp8 @ d16", "tg4 @ d16"]
    assert len(rows) == 8 and all(r.tokens_per_s > 0 for r in rows)
    from kvcli.gguf_file import open_gguf

    llm = make(32, "kv", "f16", "f16", "f16", True)
    assert rows[0].params_m * 1e6 == sum(t.n_elements for t in open_gguf(path).tensors.values())  # llama-bench's
    assert rows[0].model_mib == llm.model.weight_bytes() / 2**20 > 0
    assert not rows[0].keys_less_bias  # a llama: no K bias to take off
    md = to_markdown(rows)
    assert md.count("\n") == 1 + len(rows) and "| t.gguf |" in md
    assert json.loads(to_json(rows))[0]["type_k"] == "f16"
    assert to_csv(rows).count("\n") == len(rows) + 1


def test_info_and_fit_cli(default_model, tmp_path):
    from typer.testing import CliRunner

    from kvcli.cli import app

    r = CliRunner().invoke(app, ["info", "-m", str(default_model)])
    assert r.exit_code == 0, r.output
    assert "30 layers" in r.stdout and "210 x Q4_1" in r.stdout and "q4_hadamard" in r.stdout
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": [{"type_k": "q8_0", "type_v": "q8_0", "mean_kld": 0.0005},
                                          {"type_k": "q4_0", "type_v": "q4_0", "mean_kld": 0.14}]}))
    r = CliRunner().invoke(app, ["fit", "-m", str(default_model), "--mem", "1GiB", "--ctx", "32768",
                                 "--sweep", str(sweep), "--weights", "f16"])
    assert r.exit_code == 0, r.output
    assert "recommended for 32,768 tokens: kv q8_0/q8_0" in r.stdout
    assert f"based on: the lowest measured KLD among the choices that fit: 0.000500 in {sweep.name}" in r.stdout
    r = CliRunner().invoke(app, ["fit", "-m", str(default_model), "--mem", "600MiB", "--ctx", "32768",
                                 "--weights", "f16"])
    assert r.exit_code == 1 and "no cache choice reaches a 32,768-token context in 600MiB" in r.stderr


def test_fit_cli_recommends_the_reference_and_says_why(default_model):
    """The issue's case: 2 GiB and the trained 8,192 tokens once recommended f32/f32 (budgets
    sized for f16 weights, hence --weights f16)."""
    from cli_checks import runner

    from kvcli.cli import app

    r = runner.invoke(app, ["fit", "-m", str(default_model), "--mem", "2GiB", "--weights", "f16"])
    assert r.exit_code == 0, r.output
    assert "recommended for 8,192 tokens: kv f16/f16 (-ctk f16 -ctv f16 -c 8192)" in r.stdout
    assert "based on: f16/f16 is the reference precision" in r.stdout
    r = runner.invoke(app, ["fit", "-m", str(default_model), "--mem", "1GiB", "--ctx", "80000",
                            "--weights", "f16"])
    assert r.exit_code == 0, r.output
    # 4.5 bits: the rotated q4_hadamard before q4_0 and iq4_nl, which lose more at the same bits
    assert "recommended for 80,000 tokens: kv q4_hadamard/q4_hadamard" in r.stdout
    assert "based on: bits per element" in r.stdout and "rotated types first" in r.stdout


@pytest.mark.parametrize("args,words", [
    (["--mem", "2GiB", "--ctx", "-5"], ["--ctx", "-5"]),
    (["--mem", "0"], ["at least 1 byte", "'0'"]),
    (["--mem", "-2GiB"], ["at least 1 byte"]),
    (["--mem", "lots"], ["cannot read a memory size", "'lots'"]),
    (["--mem", "1e400"], ["cannot read a memory size"]),
    (["--mem", "1e30GiB"], ["more than 1 PiB"]),
    (["--mem", "100MiB"], ["weights", "alone fill 100MiB"]),
    (["--mem", "2GiB", "--dtype", "f64"], ["--dtype", "f64"]),
])
def test_fit_cli_refuses_bad_values_in_one_line(default_model, args, words):
    from cli_checks import assert_clean_error, runner

    from kvcli.cli import app

    assert_clean_error(runner.invoke(app, ["fit", "-m", str(default_model), *args]), *words)


def test_fit_cli_refuses_a_sweep_file_that_is_not_one(default_model, tmp_path):
    from cli_checks import assert_clean_error, runner

    from kvcli.cli import app

    p = tmp_path / "s[1].json"
    p.write_text('{"model": "x"}')
    assert_clean_error(runner.invoke(app, ["fit", "-m", str(default_model), "--mem", "2GiB", "--sweep", str(p)]),
                       "s[1].json", "no sweep rows")


def test_bench_cli_synthetic_shape_and_errors():
    from typer.testing import CliRunner

    from kvcli.cli import app

    r = CliRunner().invoke(app, ["bench", "--shape", "smollm2-135m", "-p", "8", "-n", "2", "-r", "1", "-d", "0,8",
                                 "-ctk", "f16,q8_0", "--cache-mode", "kv,hidden", "-o", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert len(rows) == 3 * 2 * 2 and all(row["synthetic"] for row in rows)  # (2 kv + 1 hidden) x 2 depths x pp/tg
    assert {row["test"] for row in rows} == {"pp8", "tg2", "pp8 @ d8", "tg2 @ d8"}
    assert 134 < rows[0]["params_m"] < 136  # SmolLM2-135M's shape: its parameters, not its norms
    for bad, word in [(["-o", "xml"], "md, json or csv"), (["-ctk", "q9"], "unknown cache type"),
                      (["--shape", "gpt5"], "unknown --shape"), (["-p", "x"], "integers")]:
        r = CliRunner().invoke(app, ["bench", "--shape", "smollm2-135m", *bad])
        assert r.exit_code == 1 and word in r.stderr, r.output
