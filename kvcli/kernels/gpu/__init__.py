"""Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1), a launcher for each; imports triton."""
