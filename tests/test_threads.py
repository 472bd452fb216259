"""The default thread count leaves out cores that other programs keep busy (issue 14, point 8)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcli.threads import default_threads, idle_cores


def test_idle_cores_counts_the_cores_we_may_use():
    sample = idle_cores()
    if sample is None:
        pytest.skip("no /proc/stat here")
    idle, cores = sample
    assert cores == len(os.sched_getaffinity(0)) and 0 <= idle <= cores
    assert 1 <= default_threads() <= cores


def test_a_busy_core_is_left_out():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or idle_cores() is None:
        pytest.skip("needs two cores and /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\n"
                             "while True: pass", str(cores[-1])])
    try:
        import time

        time.sleep(0.5)  # let it start spinning
        lines = []
        assert default_threads(lines.append) < len(cores)
        assert lines and "busy with other programs" in lines[0] and "-t" in lines[0]
    finally:
        spin.kill()
        spin.wait()


def test_one_thread_runs_numbas_regions_in_one_thread():
    """-t 1: a kernel's prange region (the embedding's rows, a load's retiling) runs in one thread, not numba's default
    of every core: a region's second thread on a core another program keeps busy stalled each decode token by ms."""
    pytest.importorskip("numba")
    code = ("import numpy as np, torch, numba\n"
            "from kvcli.kernels.cpu import ggml_rows, compile\n"
            "torch.set_num_threads(1)\n"
            "raw = np.zeros((2, 18), np.uint8); raw.setflags(write=False)\n"
            "ggml_rows.dequantize_ids('Q4_0', raw, np.array([1], np.int64), np.empty((1, 32), np.float32))\n"
            "print(numba.get_num_threads() if compile.THREADED else 1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1"
