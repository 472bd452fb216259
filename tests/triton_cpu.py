"""The kernel table's CUDA entries run on CPU tensors: Triton's interpreter (TRITON_INTERPRET=1, set by the test
modules before triton is imported) runs the kernels, so CI without a GPU tests them."""

from __future__ import annotations


def cuda_entries_on_cpu(monkeypatch) -> None:
    """From here on, caches made (and attention asked) choose the table's CUDA entries for CPU tensors."""
    import kvcli.attention
    import kvcli.kernel_table as table

    monkeypatch.setattr(kvcli.attention, "device_of", lambda x: "cuda")
    monkeypatch.setattr(table, "TRITON_ON", True)
