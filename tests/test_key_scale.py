"""Keys scaled for the queries (kvcli/cache/key_scale.py): the scales follow the weights as the module derives them, the
scaled basis changes nothing over an f32 cache (with keys less their mean, qwen2's bias included), the rule (auto) and
the identity of a saved state."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvcli.cache import CacheSpec, resolve_type
from kvcli.cache.key_scale import block_scales, scales_keys
from kvcli.llama import Llama
from kvcli.weights import Dense

H, HKV, D, E = 4, 2, 8, 16


def _block(q_power: torch.Tensor, k_power: torch.Tensor, bias: torch.Tensor | None = None) -> SimpleNamespace:
    """A block whose Q rows (H, D) and K rows (HKV, D) have the given powers sum_i (W_ji g_i)^2: each row one nonzero
    weight sqrt(power) / 2 on an input channel of norm weight 2."""
    rows = torch.cat([q_power.reshape(-1), k_power.reshape(-1), torch.ones(HKV * D)])
    w = torch.zeros(len(rows), E)
    w[torch.arange(len(rows)), torch.arange(len(rows)) % E] = rows.sqrt() / 2
    return SimpleNamespace(wqkv=Dense(w), attn_norm=torch.full((E,), 2.0), bqkv=bias, qk_norm=None)


CONFIG = SimpleNamespace(n_heads=H, n_kv_heads=HKV, head_dim=D, rope_neox=True)


def test_scales_are_the_fourth_root_of_key_over_query_power_per_rope_pair():
    """s_j = (a_j / b_j)^(1/4), a and b averaged over each NEOX pair (j, j + D/2), b over the K head's queries; the
    q heads take s and the K heads 1 / s; geometric mean 1; gain (sum sqrt(ab))^2 / (sum a sum b)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(H, D, generator=g) + 0.1, torch.rand(HKV, D, generator=g) + 0.1
    mult, gain = block_scales(_block(q, k), CONFIG)
    pair = lambda x: torch.cat([(x[..., :4] + x[..., 4:]) / 2] * 2, -1)
    a, b = pair(k), pair(q.view(HKV, 2, D).mean(1))
    s = (a / b).pow(0.25)
    s = s / s.log().mean(-1, keepdim=True).exp()
    torch.testing.assert_close(mult[:H], s.repeat_interleave(2, 0))
    torch.testing.assert_close(mult[H:], 1 / s)
    torch.testing.assert_close(mult[:, :4], mult[:, 4:])  # one value per pair: it commutes with RoPE
    torch.testing.assert_close(gain, (a * b).sqrt().sum(-1) ** 2 / (a.sum(-1) * b.sum(-1)))
    assert (gain <= 1 + 1e-6).all()


def test_matched_powers_leave_keys_as_they_are():
    """Queries that look at each channel as much as keys fill it: s = 1, gain 1; a q bias adds its square."""
    p = torch.linspace(1, 4, D).expand(HKV, D)
    mult, gain = block_scales(_block(p.repeat_interleave(2, 0), p), CONFIG)
    torch.testing.assert_close(mult, torch.ones(H + HKV, D))
    torch.testing.assert_close(gain, torch.ones(HKV))
    bias = torch.cat([torch.full((H * D,), 1.0), torch.zeros(2 * HKV * D)])
    mult, _ = block_scales(_block(p.repeat_interleave(2, 0) - 1 + 1e-9, p, bias), CONFIG)
    torch.testing.assert_close(mult, torch.ones(H + HKV, D), rtol=1e-4, atol=1e-4)


def test_auto_follows_the_predicted_gain_and_the_type():
    """auto: kvcli's rotated K types where the mean gain is GAIN_RULE or less; on: any type; off: none."""
    from kvcli.cache import key_scale

    k = torch.tensor([1e-3, 1e-3, 1, 1] * 2).expand(HKV, D)  # keys fill pairs 2-3 (NEOX: j and j + 4)
    q_far = torch.tensor([1, 1, 1e-3, 1e-3] * 2).expand(H, D)  # queries read pairs 0-1
    for q, on in ((q_far, True), (k.repeat_interleave(2, 0), False)):
        model = torch.nn.Module()  # a Transformer's parts the scales read
        model.c, model.blocks = CONFIG, [_block(q, k)]
        assert bool(key_scale.model_scales(model)[1].mean() <= key_scale.GAIN_RULE) is on
        assert scales_keys("auto", resolve_type("tq3"), model) is on
        assert scales_keys("auto", resolve_type("q4_hadamard"), model) is on
        assert not scales_keys("auto", resolve_type("q8_0"), model) and not scales_keys("auto", resolve_type("f16"), model)
        assert scales_keys("on", resolve_type("q8_0"), model) and not scales_keys("off", resolve_type("tq3"), model)
    with pytest.raises(Exception, match="--key-scales"):
        CacheSpec("kv", "tq3", "tq3", key_scales="yes")


@pytest.fixture(scope="module")
def qwen2_f32(tmp_path_factory):
    """A tiny random qwen2 (q, k, v biases, NEOX pairs) in f32."""
    from kvcli.convert import convert_hf
    from tiny import make_hf_qwen, qwen_tokenizer

    d = tmp_path_factory.mktemp("qwen2s") / "hf"
    make_hf_qwen(arch="qwen2", hidden=128, vocab=300, seed=5).save_pretrained(d)
    rng = random.Random(0)
    qwen_tokenizer(d, 300, ["".join(rng.choice("abcdefgh ijklmnop.qrstuvwxyz") for _ in range(60)) for _ in range(400)])
    return convert_hf(d, d.parent / "m.gguf", outtype="f32", progress=False, log=lambda line: None)


def _logits(llm: Llama) -> list[torch.Tensor]:
    """A 7-token prefill, then 5 greedy decode tokens: each step's logits."""
    cache, model = llm.new_cache(llm.cache_spec), llm.model
    logits = model(torch.tensor([[7, 100, 33, 250, 12, 5, 9]]), cache, 0)
    out, pos = [logits], 7
    for _ in range(5):
        logits = model(torch.tensor([[int(logits[0, -1].argmax())]]), cache, pos)
        out.append(logits)
        pos += 1
    return out


@pytest.mark.parametrize("type_k", ["f32", "f32=0+f16"])
def test_f32_cache_gives_the_same_logits_in_the_scaled_basis(qwen2_f32, type_k):
    """q * s . k / s over an f32 store, keys less their mean (the K bias scaled with them): the plain cache's logits, at
    prefill and decode, one type or one per layer (each group's scales); the size line says so."""
    plain = Llama(qwen2_f32, ctx_size=64, threads=1, cache_type_k="f32", cache_type_v="f32", cache_key_bias="off",
                  cache_key_scales="off")
    scaled = Llama(qwen2_f32, ctx_size=64, threads=1, cache_type_k=type_k, cache_type_v="f32", cache_key_bias="on",
                   cache_key_scales="on")
    cache = scaled.new_cache(scaled.cache_spec)
    assert all(cache.qk_scales(i) is not None for i in range(scaled.config.n_layers))
    assert "keys scaled" in cache.describe() and "keys less their mean" in cache.describe()
    from kvcli.cache.key_scale import model_scales

    gains = model_scales(scaled.model)[1]  # (L, Hkv): each group's line names the mean over its layers
    for _, layers in getattr(cache, "parts", [(cache, list(range(scaled.config.n_layers)))]):
        gain = float(gains[list(layers)].mean())
        assert f"keys scaled for the queries (predicted score error {gain:.2f}x)" in cache.describe()
    s = cache.qk_scales(0)
    assert not torch.allclose(s, torch.ones_like(s))  # random weights: not the identity
    for a, b in zip(_logits(scaled), _logits(plain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_state_saved_scaled_names_it():
    """The identity a restoring cache must share says the keys are scaled (a cache without is refused); a plain
    cache's identity is what it was."""
    from kvcli.cache import KVCache
    from kvcli.attention import Attention
    from kvcli.cache.state import cache_identity

    plain = KVCache(2, 1, HKV, 64, 64, "tq3", "tq3", attention=Attention())
    scaled = KVCache(2, 1, HKV, 64, 64, "tq3", "tq3", attention=Attention(), qk_scale=torch.ones(2, H + HKV, 64))
    assert "keys scaled for the queries" not in cache_identity(plain)
    assert cache_identity(scaled) == {**cache_identity(plain), "keys scaled for the queries": True}
