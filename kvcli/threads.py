"""The default CPU thread count: the cores that are idle when kvcli starts.

torch's intra-op threads spin while they wait for each other, so one thread sharing its core
with a busy program stalls every step: on a 2-core machine with one core busy, decode at 2
threads ran at a quarter of its quiet speed, at 1 thread it hardly changed (figures in
benchmarks/README.md). Counting the idle cores over a short sample avoids that case; -t
overrides it."""

from __future__ import annotations

import os
import time

BUSY_FRACTION = 0.5  # a core busier than this over the sample counts as taken
SAMPLE_SECONDS = 0.1


def _cpu_times() -> dict[int, tuple[int, int]]:
    """cpu index -> (idle ticks, total ticks) from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out


def idle_cores() -> tuple[int, int] | None:
    """(idle cores, cores this process may use), or None where /proc/stat cannot tell."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
        before = _cpu_times()
        time.sleep(SAMPLE_SECONDS)
        after = _cpu_times()
    except (OSError, AttributeError, ValueError):
        return None
    idle = 0
    for cpu in allowed:
        if cpu not in before or cpu not in after:
            return None
        d_idle, d_total = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
        if d_total <= 0 or 1 - d_idle / d_total < BUSY_FRACTION:
            idle += 1
    return idle, len(allowed)


def default_threads(log=None) -> int:
    """Threads for a run without -t: the idle cores (at least 1), else every core we may use."""
    sample = idle_cores()
    if sample is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    idle, cores = sample
    if idle < cores and log is not None:
        log(f"threads: {max(1, idle)} ({cores - idle} of {cores} cores busy with other programs; -t N sets it)")
    return max(1, idle)
