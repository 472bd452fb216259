"""Keys stored less their turning mean (kvcli/cache/key_bias.py): the add-back is exact, each sequence's mean is its
first batch's, the cache-level treatment changes nothing over an f32 store, and the rule (auto: kvcli's rotated
types) holds."""

from __future__ import annotations

import pytest
import torch

from kvcli.attention import Attention, attend_reference
from kvcli.cache import CacheSpec, KVCache, resolve_type
from kvcli.cache.key_bias import KeyBias, treats
from kvcli.cache.spec import treats_keys
from kvcli.rope import apply_rope
from tests.test_kernel_table import key_bias

HKV, D = 2, 64


@pytest.mark.parametrize("neox", [False, True])
def test_scores_are_q_dot_rotated_bias(neox):
    """scores(q) at positions p = q . R(p) b, computed straight from RoPE, at a table with YaRN's mscale (1.1)."""
    kb = key_bias(300, neox)
    q = torch.randn(3, HKV, 5, D, dtype=torch.float32)
    got = kb.scores(0, q, 17, 300)
    rb = apply_rope(kb.bias[0].expand(1, 300, -1, -1), kb.rot, neox)[0, 17:]  # (n, H, D)
    want = torch.einsum("bhrd,nhd->bhrn", q.double(), rb.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("neox", [False, True])
def test_remove_is_rotated_bias_at_each_position(neox):
    """remove at an int start and at per-row positions (a (B,) tensor, T = 1) subtracts R(p) b of each position
    (b: a sequence's mean before its first batch)."""
    kb = key_bias(64, neox).for_rows(2)
    k = torch.randn(2, 5, HKV, D)
    rb = apply_rope(kb.bias[0].expand(1, 64, -1, -1), kb.rot, neox)[0]  # (64, H, D)
    torch.testing.assert_close(kb.remove(0, k, 9), k - rb[9:14])
    pos = torch.tensor([3, 40])
    torch.testing.assert_close(kb.remove(0, k[:, :1], pos), k[:, :1] - rb[pos].unsqueeze(1))


@pytest.mark.parametrize("window", [0, 8])
def test_f32_cache_attends_the_same_with_keys_less_their_bias(window):
    """Over an f32 K store the treatment only moves rounding: prefill and decode steps attend as the plain cache."""
    n_ctx = 96
    kb = key_bias(n_ctx)
    g = torch.Generator().manual_seed(1)
    plain, treated = (KVCache(1, 1, HKV, n_ctx, D, "f32", "f32", attention=Attention(), window=window, key_bias=b)
                      for b in (None, kb))
    k_pre = torch.randn(1, 60, HKV, D, generator=g)
    keys = apply_rope(k_pre + kb.bias[0], kb.rot[:60], kb.neox)  # as qwen2 makes them: RoPE(W x + b)
    vals = torch.randn(1, 60, HKV, D, generator=g)
    for pos, T in ((0, 40), (40, 1), (41, 1), (42, 18)):
        q = torch.randn(1, T, 2 * HKV, D, generator=g)
        outs = [attend_reference(q, c, 0, pos, recent=c.store(0, keys[:, pos : pos + T], vals[:, pos : pos + T], pos))
                for c in (plain, treated)]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("neox", [False, True])
def test_mean_is_each_sequences_first_batch_before_rope(neox):
    """start: the mean of the first batch's keys past the sinks, taken back before RoPE, per sequence (a row view
    sets its own); a batch of no more than the sinks: the bias. remove then takes R(p) m of that sequence off."""
    from kvcli.cache.key_bias import N_SINK

    kb = key_bias(64, neox).for_rows(3)
    g = torch.Generator().manual_seed(3)
    pre = torch.randn(2, 20, HKV, D, generator=g) + torch.randn(2, 1, HKV, D, generator=g) * 5  # a mean per row
    keys = apply_rope(pre, kb.rot[:20], neox)
    kb.rows(0, 2).start(0, keys)
    torch.testing.assert_close(kb.mean[0, :2], pre[:, N_SINK:].mean(1), rtol=1e-5, atol=1e-5)
    kb.rows(2, 3).start(0, keys[:1, :N_SINK])
    torch.testing.assert_close(kb.mean[0, 2], kb.bias[0])
    rm = apply_rope(kb.mean[0, :2, None].expand(-1, 20, -1, -1), kb.rot[:20], neox)
    torch.testing.assert_close(kb.rows(0, 2).remove(0, keys, 0), keys - rm)


def test_rule_auto_treats_rotated_types_only():
    assert treats("auto", resolve_type("tq3")) and treats("auto", resolve_type("q4_hadamard"))
    assert not treats("auto", resolve_type("q8_0")) and not treats("auto", resolve_type("f16"))
    assert treats("on", resolve_type("q8_0")) and not treats("off", resolve_type("tq3"))


def test_treated_layers_follow_the_model_and_the_types():
    """The layers whose K type the policy treats (per-layer types too), on a model with a K bias or without."""
    from kvcli.config import ModelConfig

    shape = dict(n_layers=4, n_embd=64, n_ff=64, n_heads=2, n_kv_heads=1, head_dim=32, vocab_size=10,
                 context_length=64, rms_eps=1e-6, rope_base=10000.0)
    qwen, llama = ModelConfig("qwen2", **shape, qkv_bias=True), ModelConfig("llama", **shape)
    assert treats_keys(llama, CacheSpec("kv", "tq3", "tq3")) == [0, 1, 2, 3]
    assert treats_keys(qwen, CacheSpec("kv", "tq3", "tq3")) == [0, 1, 2, 3]
    assert treats_keys(qwen, CacheSpec("kv", "q8_0=0+tq3", "tq3")) == [1, 2, 3]
    assert treats_keys(qwen, CacheSpec("kv", "q8_0=0+tq3", "tq3", key_bias="on")) == [0, 1, 2, 3]
    assert treats_keys(qwen, CacheSpec("kv", "tq3", "tq3", key_bias="off")) == []
    with pytest.raises(Exception, match="--key-bias"):
        CacheSpec("kv", "tq3", "tq3", key_bias="yes")


def test_run_warns_of_a_known_loss():
    """q8_0 on a qwen2 model with its keys as they come: the measured +3.4% named; treated, or on llama: no row;
    tq3 at its defaults (treated): measured below 1%, no warning; tq2: +5.98%."""
    from kvcli.cache.known_loss import loss_warning
    from kvcli.config import ModelConfig

    shape = dict(n_layers=4, n_embd=64, n_ff=64, n_heads=2, n_kv_heads=1, head_dim=32, vocab_size=10,
                 context_length=64, rms_eps=1e-6, rope_base=10000.0)
    qwen, llama = ModelConfig("qwen2", **shape, qkv_bias=True), ModelConfig("llama", **shape)
    spec = CacheSpec("kv", "q8_0", "q8_0")
    line = loss_warning(qwen, spec, keys_less_bias=False)
    assert "+3.4% perplexity" in line and "--key-bias on" in line and "\n" not in line
    assert loss_warning(qwen, spec, keys_less_bias=True) is None
    assert loss_warning(llama, spec, keys_less_bias=False) is None
    assert "+16.9%" in loss_warning(llama, CacheSpec("kv", "q4_0", "q4_0"), keys_less_bias=False)
    assert loss_warning(qwen, CacheSpec("kv", "tq3", "tq3"), keys_less_bias=True) is None
    assert "+5.98%" in loss_warning(qwen, CacheSpec("kv", "tq2", "tq2"), keys_less_bias=True)
    line = loss_warning(qwen, CacheSpec("kv", "tq2", "tq2"), keys_less_bias=True, keys_scaled=True)  # the default there
    assert "+2.79%" in line and "scaled" in line
    assert loss_warning(qwen, CacheSpec("kv", "tq3", "tq3"), keys_less_bias=True, keys_scaled=True) is None


def test_keys_less_their_mean_cost_their_means_and_say_so():
    """The treatment keeps the type's bytes (and so its bits per element) plus each sequence's means, f32, and the
    size line names it."""
    plain, treated = (KVCache(2, 3, HKV, 256, D, "tq3", "tq3", attention=Attention(), window=16,
                              key_bias=None if i == 0 else KeyBias(key_bias(256).bias.expand(2, -1, -1), key_bias(256).rot,
                                                                   True)) for i in range(2))
    assert plain.nbytes() == KVCache.bytes_needed(2, 3, HKV * D, 256, "tq3", "tq3", 16)
    assert treated.nbytes() == plain.nbytes() + 2 * 3 * HKV * D * 4
    assert "keys less their mean" in treated.describe() and "mean" not in plain.describe()
    from kvcli.cache.spec import cache_bytes
    from kvcli.config import ModelConfig

    llama = ModelConfig("llama", n_layers=2, n_embd=128, n_ff=64, n_heads=4, n_kv_heads=HKV, head_dim=D,
                        vocab_size=10, context_length=256, rms_eps=1e-6, rope_base=10000.0)
    planned = [cache_bytes(llama, CacheSpec("kv", "tq3", "tq3", window=16, key_bias=kb), 256, 3) for kb in ("off", "auto")]
    assert planned == [plain.nbytes(), treated.nbytes()]
