"""Layer (e): the CLI end to end through typer's CliRunner, bad inputs included."""

import gguf
import numpy as np
import pytest

from kvcli.cli import app
from cli_checks import assert_clean_error, run, runner
from tiny import write_gguf


def test_greedy_run_is_deterministic(tiny):
    a = run("-m", tiny, "-p", "the the", "-n", 12, "--temp", 0, "-c", 64, "--dtype", "f32")
    b = run("-m", tiny, "-p", "the the", "-n", 12, "--temp", 0, "-c", 64, "--dtype", "f32")
    assert a.exit_code == 0, a.output
    assert a.stdout == b.stdout and a.stdout.startswith("the the")
    assert "KV cache: size =" in a.stderr and "K (f16)" in a.stderr and "V (f16)" in a.stderr
    assert "prompt eval time" in a.stderr and "tokens per second" in a.stderr


def test_cache_size_line_is_the_real_byte_count(tiny):
    r = run("-m", tiny, "-p", "hi", "-n", 1, "-c", 128, "-ctk", "f32", "-ctv", "f16")
    assert r.exit_code == 0, r.output
    # 2 layers x 128 cells x kv_dim 32 (2 heads x 16) x (4 + 2) bytes
    assert "size =    0.05 MiB (   128 cells,   2 layers" in r.stderr
    assert "K (f32):    0.03 MiB, V (f16):    0.02 MiB" in r.stderr


def test_generation_stops_at_context_end(tiny):
    r = run("-m", tiny, "-p", "the", "-n", 100, "-c", 8, "--temp", 0)
    assert r.exit_code == 0, r.output
    assert "context full" in r.stderr


def test_missing_file(tmp_path):
    assert_clean_error(run("-m", tmp_path / "nope.gguf", "-p", "x"), "not found")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model" * 10)
    assert_clean_error(run("-m", p, "-p", "x"), "not a GGUF")


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated(tiny, tmp_path, keep):
    data = tiny.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    assert_clean_error(run("-m", p, "-p", "x"), "truncated")


def test_unsupported_architecture(hf, tmp_path):
    p = write_gguf(hf, tmp_path / "arch.gguf", arch="gptneox")
    assert_clean_error(run("-m", p, "-p", "x"), "unsupported architecture", "gptneox")


def test_missing_tensor(hf, tmp_path):
    p = write_gguf(hf, tmp_path / "miss.gguf", drop="blk.1.ffn_up.weight")
    assert_clean_error(run("-m", p, "-p", "x"), "blk.1.ffn_up.weight")


def test_wrong_shape(hf, tmp_path):
    p = write_gguf(hf, tmp_path / "shape.gguf", overrides={"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)})
    assert_clean_error(run("-m", p, "-p", "x"), "blk.0.attn_k.weight", "shape")


def test_unsupported_tensor_type(hf, tmp_path):
    # Q8_1 is a ggml type gguf-py cannot dequantize: 32 elements in 40 bytes.
    raw = np.zeros((192, 64 // 32 * 40), dtype=np.uint8)
    p = write_gguf(hf, tmp_path / "q81.gguf", raw={"blk.0.ffn_gate.weight": (raw, gguf.GGMLQuantizationType.Q8_1)})
    assert_clean_error(run("-m", p, "-p", "x"), "unsupported type", "Q8_1")


def test_block_type_needs_divisible_head_size(tiny):
    assert_clean_error(run("-m", tiny, "-p", "x", "-ctk", "q4_0"), "divisible by 32")


def test_unknown_cache_type(tiny):
    assert_clean_error(run("-m", tiny, "-p", "x", "-ctk", "q3_9"), "unknown cache type", "f16")


def test_prompt_longer_than_context(tiny):
    assert_clean_error(run("-m", tiny, "-p", "the " * 50, "-c", 16), "longer than", "context")


def test_context_that_does_not_fit_in_memory(tiny):
    assert_clean_error(run("-m", tiny, "-p", "x", "-c", 2**31), "does not fit in memory", "GiB")


def test_empty_prompt(tiny):
    assert_clean_error(run("-m", tiny, "-p", ""), "empty prompt")


def test_help_is_plain():
    r = runner.invoke(app, ["run", "--help"])
    assert r.exit_code == 0
    for flag in ["--ctx-size", "--cache-type-k", "--cache-type-v", "--conversation", "--n-predict", "--repeat-penalty"]:
        assert flag in r.stdout


def test_conversation_through_chat_template(default_model):
    r = runner.invoke(app, ["run", "-m", str(default_model), "-cnv", "--temp", "0", "-n", "24", "-c", "512"],
                      input="What is the capital of France?\nAnd of Italy?\n")
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout and "Rome" in r.stdout
    assert r.stderr.count("prompt eval time") == 1


def test_conversation_without_template(tiny):
    r = runner.invoke(app, ["run", "-m", str(tiny), "-cnv"], input="hi\n")
    assert r.exit_code == 1 and "chat template" in r.stderr


def test_80k_context_q4_0_on_default_model(default_model):
    r = runner.invoke(app, ["run", "-m", str(default_model), "-c", "80000", "-ctk", "q4_0", "-ctv", "q4_0",
                            "-p", "The capital of France is", "-n", "4", "--temp", "0"])
    assert r.exit_code == 0, r.output
    # 30 layers x 80000 cells x 192 (kv_dim) x 4.5 bits, for K and again for V
    exact = 2 * 30 * 80000 * 192 * 18 // 32
    assert f"size = {exact / 2**20:7.2f} MiB ( 80000 cells,  30 layers" in r.stderr
    assert "K (q4_0)" in r.stderr and "V (q4_0)" in r.stderr


def test_flash_attn_flag(tiny, monkeypatch):
    """-fa on (online softmax over chunks) and off (materialized scores, V streamed) give the same
    greedy text on a prompt longer than one attention chunk, where the two paths run different code."""
    import kvcli.attention

    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 0)  # chunks of MIN_CHUNK positions, as at a long context
    prompt = "the " * (kvcli.attention.MIN_CHUNK + 40)
    on = run("-m", tiny, "-p", prompt, "-n", 6, "--temp", 0, "-c", 512, "-fa", "on", "-ctv", "bf16", "--dtype", "f32")
    off = run("-m", tiny, "-p", prompt, "-n", 6, "--temp", 0, "-c", 512, "-fa", "off", "-ctv", "bf16", "--dtype", "f32")
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    assert "prompt eval time" in on.stderr and on.stdout == off.stdout
    assert_clean_error(run("-m", tiny, "-p", "x", "-fa", "maybe"), "on, off or auto")


def test_a_long_prefill_reads_the_cache_in_chunks_of_bounded_scores():
    """A 512-token batch of a 7:1 GQA model (Qwen2.5-0.5B's 14 query and 2 KV heads, D 64) at 32k: the scores of a
    block of its rows (B, Hkv, ROW_BLOCK, n) per chunk stay within the scratch budget, not 940 MB over the whole
    context."""
    from kvcli.attention import CHUNK_BYTES, MIN_CHUNK, ROW_BLOCK, chunk_positions

    n = chunk_positions(1, 2, ROW_BLOCK, 64)
    assert ROW_BLOCK < 7 * 512 and MIN_CHUNK <= n < 32768 and 4 * 2 * ROW_BLOCK * n <= CHUNK_BYTES
    assert 4 * 2 * chunk_positions(1, 2, 7, 64) * 64 <= CHUNK_BYTES  # a decode step: K's chunk is the larger
    assert chunk_positions(64, 8, 4096, 128) == MIN_CHUNK


def test_model_as_argument_and_ctx_alias(tiny):
    """`kvcli run model.gguf --ctx N` as llama.cpp users type it; -m and --ctx-size still work."""
    a = run(tiny, "--ctx", 64, "-p", "the the", "-n", 4, "--temp", 0)
    b = run("-m", tiny, "--ctx-size", 64, "-p", "the the", "-n", 4, "--temp", 0)
    assert a.exit_code == 0, a.output
    assert a.stdout == b.stdout and "(    64 cells" in a.stderr
    assert_clean_error(run(tiny, "-m", tiny.with_name("other.gguf"), "-p", "x"), "two models given")
    for command in (["info", str(tiny)], ["fit", str(tiny), "--mem", "1GiB", "--ctx", "64"]):
        r = runner.invoke(app, command)
        assert r.exit_code == 0, r.output


def test_the_specified_command_line(default_model):
    """The line kvcli was specified with: `kvcli run model.gguf --ctx 80000 --cache-type-k q4`."""
    r = runner.invoke(app, ["run", str(default_model), "--ctx", "80000", "--cache-type-k", "q4", "-p",
                            "The three primary colors are", "-n", "4", "--temp", "0"])
    assert r.exit_code == 0, r.output
    assert "( 80000 cells" in r.stderr and "K (q4_hadamard)" in r.stderr

def test_pull_says_the_model_is_already_there(default_model):
    r = runner.invoke(app, ["pull"])
    assert r.exit_code == 0 and "is already there" in r.stderr and default_model.name in r.stderr
