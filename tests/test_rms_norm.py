"""RMSNorm (kvcli.weights.rms_norm, through the table's NORM entries): each entry this machine runs (the CPU's compiled
pass, kvcli/kernels/cpu/norm.py; the reference, F.rms_norm) against F.rms_norm, a row's bits alone and beside others;
the choice made once per device and dtypes."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import kvcli.weights
from kvcli import kernel_table as table
from kvcli.kernel_table import NORM
from kvcli.weights import rms_norm

ENTRIES = [pytest.param(e, id=e.device) for e in table.entries(NORM) if e.device != "any"] \
    + [pytest.param(table.reference(NORM), id="reference")]


def _runnable(entry: table.Entry) -> None:
    reason = "" if entry.device == "any" else table.why_not(entry, "cpu")
    if reason:
        pytest.skip(f"{entry.name}: {reason}")


@pytest.mark.parametrize("entry", ENTRIES)
def test_equals_torch_and_rows_are_independent(entry):
    _runnable(entry)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g)
    x = torch.randn(3, 70, 576, generator=g) * torch.logspace(-3, 3, 70)[:, None]  # rows of very different scales
    got = entry.run(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-6, atol=1e-6)
    for b, t in ((0, 0), (1, 33), (2, 69)):
        assert torch.equal(entry.run(x[b, t : t + 1], w, 1e-5), got[b, t : t + 1])
    strided = x.transpose(0, 1)  # any layout
    torch.testing.assert_close(entry.run(strided, w, 1e-5), got.transpose(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_head_size_off_the_lanes(entry):
    _runnable(entry)
    x, w = torch.randn(4, 100), torch.rand(100)  # 100: a tail past the 16-lane sums
    torch.testing.assert_close(entry.run(x, w, 1e-6), F.rms_norm(x, (100,), w, 1e-6), rtol=1e-6, atol=1e-6)


def test_rms_norm_asks_the_table_once_per_dtypes(monkeypatch):
    """rms_norm runs the table's choice for f32 on this CPU (the compiled pass where numba loads), torch's own for
    other dtypes, and asks once per device and dtypes."""
    monkeypatch.setattr(kvcli.weights, "_NORMS", {})
    asked = []
    choose = table.choose
    monkeypatch.setattr(table, "choose", lambda *a, **k: asked.append(a) or choose(*a, **k))
    x, w = torch.randn(4, 100), torch.rand(100)
    for _ in range(3):
        torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (100,), w, 1e-6), rtol=1e-6, atol=1e-6)
    xh = x.half()  # not f32: torch's own
    for _ in range(2):
        assert torch.equal(rms_norm(xh, w.half(), 1e-6), F.rms_norm(xh, (100,), w.half(), 1e-6))
    with warnings.catch_warnings():  # torch: mixed dtypes take its unfused path
        warnings.simplefilter("ignore", UserWarning)
        assert torch.equal(rms_norm(x, w.half(), 1e-6), F.rms_norm(x, (100,), w.half(), 1e-6))  # mixed: the reference
    assert asked == [(NORM, "cpu", "float32"), (NORM, "cpu", "float16"), (NORM, "cpu", "float32*float16")]
    assert kvcli.weights._NORMS[("cpu", torch.float32, torch.float32)] is choose(NORM, "cpu", "float32").run
    assert kvcli.weights._NORMS[("cpu", torch.float16, torch.float16)] is table.reference(NORM).run
