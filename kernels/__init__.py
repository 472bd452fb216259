"""Triton kernels (CUDA) with their PyTorch references beside them.

`use_triton(t)` is the one switch every dispatch point asks: a CUDA tensor, and the kernels not
turned off with KVCLI_TRITON=0 (which runs the PyTorch reference on the GPU, to show the
kernels' gain). This module never imports triton itself.
"""

import os


def use_triton(t) -> bool:
    return t.is_cuda and os.environ.get("KVCLI_TRITON", "1") != "0"
