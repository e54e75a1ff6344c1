"""``python benchmarks/rtt_cpu.py [N]``: CPU per sequential driver round trip, per process.

The driver runs ``yr.get(f.invoke(i))`` N times (default 4 000, after 500 warm-up calls) on
the embedded 2-worker cluster, as ``task_rtt_ms`` does; wall-clock medians swing with the
machine's load, CPU per round trip much less.  Each process's idle CPU rate, measured for
1.5 s just before, is subtracted.  Prints one line: the round trip's p10 and p50 in ms, then
µs of CPU per round trip in the driver (which hosts the scheduler) and in each other process,
largest first (the worker that ran the tasks comes first).

Run it by its path, not with ``-m`` from a worktree's root: there the worktree's ``yrdask``
comes before ``PYTHONPATH``, so a baseline (``PYTHONPATH=<its worktree>``) would measure this
tree (the same holds for ``benchmarks/nested_cpu.py``).
"""

from __future__ import annotations

import sys
import time

import psutil

import yrdask as yr

try:  # python -m benchmarks.X, or run by path (sys.path[0] is this folder)
    from benchmarks.common import CpuMeter
except ImportError:
    from common import CpuMeter


@yr.invoke
def echo(i):
    return i


def main(n: int) -> None:
    yr.init()
    try:
        for i in range(500):
            yr.get(echo.invoke(i))
        me = psutil.Process()
        meter = CpuMeter([me] + me.children(recursive=True))
        meter.idle()
        lat = []
        pc = time.perf_counter
        for i in range(n):
            t = pc()
            yr.get(echo.invoke(i))
            lat.append(pc() - t)
        per = meter.per_item(n)
        lat.sort()
        others = sorted((v for pid, v in per.items() if pid != me.pid), reverse=True)
        print(f"rtt p10 {lat[n // 10] * 1e3:.3f} p50 {lat[n // 2] * 1e3:.3f} ms  driver "
              f"{per[me.pid]:6.1f}  others " + " ".join(f"{v:6.1f}" for v in others)
              + " us per round trip (idle subtracted)")
    finally:
        yr.finalize()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
