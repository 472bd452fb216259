"""The kernels: leaves that take tensors or arrays and the layout records of kvcli/kernels/layout.py, and import
nothing from the rest of kvcli. Which one runs is the kernel table's choice (kvcli/kernel_table.py, whose entries
kvcli/attention.py and kvcli/weights.py register); the PyTorch references they are tested against live in the
library (kvcli.attention.attend_reference, the stores' quantize_reference, the weight forms' dequantize).

One folder per device, the same roles in each:
    role                          cpu/ (numba, LLVM vectors; torch)        gpu/ (Triton)
    attention over dense/ggml     attention.py                             attention.py (every kind, one kernel)
    attention over rotated codes  attention_rotated.py (q4_hadamard, tq)   attention.py
    attention, hidden-state cache -                                        hidden.py
    quantize on write             quantize.py (q4_hadamard; dense puts)    quantize.py
    weight products               weights.py (AVX512-VNNI), int4_tiles.py  weights.py
    dequantize rows               dequantize.py                            -
    norm                          norm.py                                  - (torch)
cpu/compile.py holds numba's flags and its on-disk cache (the one place it is handled); cpu/vectors.py every
llvmlite line.
"""
