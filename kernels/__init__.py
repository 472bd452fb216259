"""Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1), a launcher for each.

A leaf: launchers take tensors and a store's layout constants (kvcli.kernel_layout.KernelLayout)
and import nothing from kvcli; whether to run them is kvcli.attention's decision (its switch
`use_triton` also gates weights.py's, called by kvcli.weights.Blocks), and the PyTorch references
they are tested against live in the library. This module imports nothing.
"""
