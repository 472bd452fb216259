"""kvcli/rms_norm.py: the CPU's compiled RMSNorm against F.rms_norm, a row's bits alone and beside others."""

import torch
import torch.nn.functional as F

from kvcli.rms_norm import rms_norm


def test_equals_torch_and_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g)
    x = torch.randn(3, 70, 576, generator=g) * torch.logspace(-3, 3, 70)[:, None]  # rows of very different scales
    got = rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-6, atol=1e-6)
    for b, t in ((0, 0), (1, 33), (2, 69)):
        assert torch.equal(rms_norm(x[b, t : t + 1], w, 1e-5), got[b, t : t + 1])
    strided = x.transpose(0, 1)  # any layout
    torch.testing.assert_close(rms_norm(strided, w, 1e-5), got.transpose(0, 1), rtol=0, atol=0)


def test_head_size_off_the_lanes_and_other_dtypes():
    x, w = torch.randn(4, 100), torch.rand(100)  # 100: a tail past the 16-lane sums
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (100,), w, 1e-6), rtol=1e-6, atol=1e-6)
    xh = x.half()  # not f32: torch's own
    assert torch.equal(rms_norm(xh, w.half(), 1e-6), F.rms_norm(xh, (100,), w.half(), 1e-6))
