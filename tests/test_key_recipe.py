"""kvcli/cache/key_recipe.py: a recipe's transform is undone exactly on read, and its side data is counted."""

import math

import pytest
import torch

from kvcli.cache import resolve_type
from kvcli.cache.key_recipe import KeyRecipe, KeyRecipeStore

L, B, H, N, D = 2, 1, 2, 16, 64


def _rot(n: int, d: int) -> torch.Tensor:
    theta = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    return torch.polar(torch.ones(n, d // 2), torch.outer(torch.arange(n, dtype=torch.float64), theta).float())


def _recipes():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "none": KeyRecipe(),
        "prerope": KeyRecipe(pre_rope=True),
        "bias": KeyRecipe(bias=50 * r(L, H, D)),
        "prerope+bias+mean": KeyRecipe(pre_rope=True, bias=50 * r(L, H, D), offset=r(L, H, D)),
        "smooth": KeyRecipe(scale=r(L, H, D).abs() + 0.5),
        "out3": KeyRecipe(outliers=torch.randperm(D, generator=g)[:3].expand(L, H, 3).contiguous()),
    }


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("name", list(_recipes()))
def test_round_trip_through_f32(name, neox):
    """Over an f32 store, load(store(x)) = x, written in two batches and read from the middle."""
    s = KeyRecipeStore(resolve_type("f32")(L, B, H, N, D, keys=True), _recipes()[name], _rot(N, D), neox)
    x = 4 * torch.randn(B, N, H, D)
    s.store(1, x[:, :5], 0)
    s.store(1, x[:, 5:], 5)
    y = s.load(1, 3, N)
    tol = 2e-3 if name.startswith("out") else 2e-5  # outlier channels are kept in f16
    assert torch.allclose(y, x[:, 3:].transpose(1, 2), rtol=tol, atol=tol * 4)


def test_mixed_layers_and_side_bytes():
    """alt_layers go to the alt store untouched; nbytes counts each layer at its type plus the f16 channels."""
    inner = resolve_type("q8_0")(L, B, H, N, D, keys=True)
    alt = resolve_type("f16")(L, B, H, N, D, keys=True)
    s = KeyRecipeStore(inner, _recipes()["out3"], _rot(N, D), False, alt=alt, alt_layers=(0,))
    x = torch.randn(B, N, H, D)
    s.store(0, x, 0)
    assert torch.equal(s.load(0, 0, N), x.transpose(1, 2).half().float())
    per_layer = B * H * N * D
    want = per_layer * 8.5 / 8 + per_layer * 2 + B * H * N * 3 * 2  # q8_0 layer, f16 layer, 3 f16 channels
    assert s.nbytes() == math.ceil(want)
