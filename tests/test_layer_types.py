"""Per-layer cache types (kvcli/cache/layers.py): the spelling, a mixed cache against each layer's own cache, its
bytes in every size, the per-layer sensitivity sweep and `kvcli fit`'s per-layer mix (kvcli/layer_mix.py)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli_checks import assert_clean_error
from kvcli.attention import Attention
from kvcli.cache import CacheSpec, KVCache, cache_bytes, make_cache
from kvcli.cache import layers
from kvcli.cli import app
from kvcli.errors import KvcliError
from kvcli.layer_mix import best_mix
from kvcli.sweep import parse_sweep

L, HKV, D = 4, 2, 64


class Config:
    n_layers, n_kv_heads, head_dim, kv_dim, n_embd = L, HKV, D, HKV * D, 256


def test_spelling_is_canonical_and_checked():
    assert layers.canonical("tq3+q8_0=0-1.3") == "q8_0=0-1.3+tq3"
    assert layers.canonical("q8=1+q8=2-3") == "q8_0=1-3+f16"  # aliases resolved, ranges joined, f16 by default
    assert layers.canonical("q4") == "q4_hadamard"
    assert layers.per_layer("q8_0=0+tq3", 3) == ["q8_0", "tq3", "tq3"]
    assert CacheSpec("kv", "tq3+q8=0", "tq3") == CacheSpec("kv", "q8_0=0+tq3", "tq3")
    for bad, words in [("q8_0+tq3", "two types"), ("q8_0=x", "layers are"), ("q8_0=3-1", "backwards"),
                       ("q8_0=1+q4_0=1", "given twice"), ("zz=1", "unknown cache type")]:
        with pytest.raises(KvcliError, match=words):
            CacheSpec("kv", bad, "f16")
    with pytest.raises(KvcliError, match="past this model's 4 layers"):
        cache_bytes(Config, CacheSpec("kv", "q8_0=4+f16", "f16"), 64)


def test_a_mixed_cache_is_each_layers_own_cache():
    """Every layer of a mixed cache attends as a cache of that layer's types alone (same bytes, same output); its
    bytes are the sum of its groups', as planned; the size line names each group."""
    spec = CacheSpec("kv", "q8_0=0+tq3=3+q4_hadamard", "f16=0+tq4", key_bias="off")  # keys as the caches alone take them
    mixed = make_cache(Config, spec, 96, n_seq=2, attention=Attention())
    assert mixed.nbytes() == cache_bytes(Config, spec, 96, n_seq=2)
    assert spec.bits_per_element(L) == pytest.approx(((8.5 + 4.5 * 2 + 3.25) / 4 + (16 + 4.25 * 3) / 4) / 2)
    line = mixed.describe()
    assert "layer 0: K q8_0, V f16" in line and "layers 1-2: K q4_hadamard, V tq4" in line and "layer 3: K tq3" in line
    g = torch.Generator().manual_seed(0)
    for layer, (tk, tv) in enumerate(zip(layers.per_layer(spec.type_k, L), layers.per_layer(spec.type_v, L))):
        alone = KVCache(1, 2, HKV, 96, D, tk, tv, attention=Attention(), window=spec.window if tk != "f16" or tv != "f16" else 0)
        for T, pos in ((40, 0), (1, 40), (1, 41), (7, 42)):
            k, v = torch.randn(2, T, HKV, D, generator=g), torch.randn(2, T, HKV, D, generator=g)
            q = torch.randn(2, T, 2 * HKV, D, generator=g)
            got = mixed.attention(layer, q, k, v, None, pos)
            ref = alone.attention(0, q, k, v, None, pos)
            assert torch.equal(got, ref), (layer, T, pos)


def test_rows_of_a_mixed_cache():
    spec = CacheSpec("kv", "q8_0=1+f16", "f16")
    base = make_cache(Config, spec, 32, n_seq=3, attention=Attention())
    row = base.rows(1, 2)
    assert row.batch == 1 and row.route[1][0].k.name == "q8_0"
    k = torch.randn(1, 5, HKV, D)
    row.attention(1, torch.randn(1, 5, 2 * HKV, D), k, k, None, 0)
    assert torch.count_nonzero(base.route[1][0].k.data[0, 1]) > 0 and torch.count_nonzero(base.route[1][0].k.data[0, 0]) == 0


def test_sensitivity_sweep_and_the_mix_fit_picks():
    """`layers:K/V` sweeps each layer alone at K/V; from such rows `fit` picks, within the room, the per-layer types
    with the least summed KLD: here layer 2 is the sensitive one and stays f16 while the others go to tq2."""
    specs = parse_sweep("layers:tq2", n_layers=L)
    assert [s.type_k for s in specs] == [f"tq2={i}+f16" for i in range(L)]
    assert parse_sweep("layers:tq2/f16") == []  # before the model loads: only checked
    with pytest.raises(KvcliError, match="unknown cache type"):
        parse_sweep("layers:zz")
    measured = {s: (0.5 if i == 2 else 0.01) for i, s in enumerate(specs)}
    measured[CacheSpec("kv")] = 0.0
    n_ctx = 4096
    f16 = cache_bytes(Config, CacheSpec("kv"), n_ctx)
    room = f16 // 2  # f16 everywhere does not fit; one layer at f16 and three at tq2 does
    spec, kld = best_mix(Config, measured, room, n_ctx)
    assert layers.per_layer(spec.type_k, L) == ["tq2", "tq2", "f16", "tq2"] and kld == pytest.approx(0.03)
    assert cache_bytes(Config, spec, n_ctx) <= room
    tight = cache_bytes(Config, CacheSpec("kv", "tq2", "tq2", window=spec.window), n_ctx) + 1
    spec, kld = best_mix(Config, measured, tight, n_ctx)
    assert layers.per_layer(spec.type_k, L) == ["tq2"] * L and kld == pytest.approx(0.53)
    assert best_mix(Config, {specs[0]: 0.1}, room, n_ctx) is None  # not every layer measured


def test_the_cli_takes_per_layer_types(tmp_path):
    from tiny import make_hf_model, write_gguf

    path = write_gguf(make_hf_model(n_layers=3, n_heads=2, n_kv_heads=2), tmp_path / "t.gguf")  # head size 32
    r = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hello", "-n", "3", "--temp", "0", "-c", "64",
                                 "-ctk", "q8_0=0+q4_0", "-ctv", "q4_0=2+f16"])
    assert r.exit_code == 0, r.output
    assert "K (q8_0=0+q4_0)" in r.output and "layer 1: K q4_0, V f16" in r.output and "layer 2: K q4_0, V q4_0" in r.output
    r = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hello", "-n", "3", "-c", "64", "-ctk", "q8_0=7+q4_0"])
    assert_clean_error(r, "layer 7 is past this model's 3 layers")
