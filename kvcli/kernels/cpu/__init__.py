"""CPU kernels: numba with LLVM vectors (compile.py: flags and numba's cache; vectors.py: every llvmlite line)."""
