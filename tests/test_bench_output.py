"""What `kvcli bench` prints as cache type names: the resolved type's name (q4 -> q4_hadamard,
Q8 -> q8_0) in the table (md, json, csv) and on the progress lines, each type run once."""

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from kvcli.bench import BenchRow, combinations, to_csv, to_markdown
from kvcli.cli import app


def test_combinations_use_resolved_names_once():
    combos = combinations(["kv", "hidden"], ["q4", "q4_hadamard", "Q8"], ["q4_hadamard"], ["Q4"], ["on"])
    assert combos == [("kv", "q4_hadamard", "q4_hadamard", "-", "on"), ("kv", "q8_0", "q4_hadamard", "-", "on"),
                      ("hidden", "-", "-", "q4_hadamard", "on")]


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A tiny random Llama with head size 32, the smallest q4_hadamard takes."""
    from tiny import make_hf_model, write_gguf

    return write_gguf(make_hf_model(n_heads=2, n_kv_heads=1), tmp_path_factory.mktemp("bench") / "tiny32.gguf")


def test_bench_prints_q4_hadamard_by_name(tiny32):
    r = CliRunner().invoke(app, ["bench", str(tiny32), "-p", "4", "-n", "2", "-r", "1", "-t", "1",
                                 "-ctk", "q4,Q8", "-ctv", "q4", "-o", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(row["type_k"], row["type_v"], row["test"]) for row in rows] == [
        ("q4_hadamard", "q4_hadamard", "pp4"), ("q4_hadamard", "q4_hadamard", "tg2"),
        ("q8_0", "q4_hadamard", "pp4"), ("q8_0", "q4_hadamard", "tg2")]
    progress = r.stderr.splitlines()
    assert len(progress) == 4 and progress[0].startswith("kv q4_hadamard/q4_hadamard/- fa on pp4: "), progress
    assert progress[2].startswith("kv q8_0/q4_hadamard/- fa on pp4: "), progress

    # The same rows as a markdown table and as csv.
    rows = [BenchRow(**row) for row in rows]
    md = to_markdown(rows).splitlines()
    window = rows[0].window  # q4_hadamard's default recent window, in the table as in the rows
    assert window > 0 and all(r.window == window for r in rows)
    assert f"| kv | q4_hadamard | q4_hadamard | - | {window} | on | pp4 |" in md[2] and "| kv | q8_0 | q4_hadamard |" in md[4]
    got = [(row["type_k"], row["type_v"]) for row in csv.DictReader(io.StringIO(to_csv(rows)))]
    assert got == [("q4_hadamard", "q4_hadamard")] * 2 + [("q8_0", "q4_hadamard")] * 2
