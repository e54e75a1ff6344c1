"""``python -m benchmarks.nested_cpu nest|burst``: CPU per nested item, per process.

Wall-clock figures are noise on a shared machine; CPU per item moves less.  ``nest`` runs
6 000 sequential nested round trips inside one task (submit a child, ``yr.get`` it), ``burst``
5 000 children submitted then gathered with one ``yr.get``, on the embedded 2-worker cluster.
Each process's idle CPU rate, measured for 1.5 s just before, is subtracted (Dask's periodic
callbacks cost more per item the longer an item takes).  Prints one line: µs per item in the
parent's worker, in the driver (which hosts the scheduler) and in the other processes.
Compare a baseline by running it with ``PYTHONPATH`` set to the baseline's worktree,
alternating (docs/changelog/performance-history.md, "2026-11-26: Nested tasks").
"""

from __future__ import annotations

import os
import sys
import time

import psutil

import yrdask as yr

try:  # python -m benchmarks.X, or run by path (sys.path[0] is this folder)
    from benchmarks.common import CpuMeter
except ImportError:
    from common import CpuMeter


@yr.invoke
def inc(i):
    return i + 1


@yr.invoke
def sequential(n):
    t0 = time.perf_counter()
    for i in range(n):
        yr.get(inc.invoke(i))
    return (time.perf_counter() - t0) / n * 1e3, os.getpid()


@yr.invoke
def burst(n):
    t0 = time.perf_counter()
    yr.get([inc.invoke(i) for i in range(n)])
    return n / (time.perf_counter() - t0), os.getpid()


def main(kind: str) -> None:
    task, n = (sequential, 6000) if kind == "nest" else (burst, 5000)
    yr.init()
    try:
        yr.get(sequential.invoke(300))
        yr.get(burst.invoke(300))
        me = psutil.Process()
        meter = CpuMeter([me] + me.children(recursive=True))
        meter.idle()
        rate, wpid = yr.get(task.invoke(n))
        per = meter.per_item(n)
        other = sum(v for pid, v in per.items() if pid not in (me.pid, wpid))
        what = f"nested rtt {rate:.3f} ms" if kind == "nest" else f"burst {rate:.0f} tasks/s"
        print(f"{what}  parent's worker {per.get(wpid, 0.0):6.1f}  driver+scheduler "
              f"{per[me.pid]:5.1f}  others {other:5.1f} us per item (idle subtracted)")
    finally:
        yr.finalize()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("nest", "burst"):
        raise SystemExit("usage: python -m benchmarks.nested_cpu nest|burst")
    main(sys.argv[1])
