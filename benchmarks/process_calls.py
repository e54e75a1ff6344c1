"""``python -m benchmarks.process_calls [N] [--light] [--top K]``: what one sequential
method call costs the process that hosts the instance.

N (default 5 000) calls of ``get(h.inc.invoke(1))`` on one instance of the embedded 2-CPU
cluster, after 300 warm-up calls: a process instance (its own process), or a light one
(``--light``: its worker's process).  Measured twice, over N calls each: the hosting
process's CPU per call (``psutil``, its idle rate subtracted), then the Python calls per
call in that process (a profile function on the thread that runs the calls and on the
process's event loop thread, :class:`benchmarks.workloads.CallProbe`).  Prints one JSON
line: the yrdask checkout measured, µs of CPU per call, Python calls per call in all, in
yrdask's modules, in Dask's and tornado's, in asyncio's; with ``--top K`` also the K most
called functions per call.  To measure another checkout, run it from outside a worktree's
root with that checkout's root after a folder holding this ``benchmarks`` on ``PYTHONPATH``.  The
counts do not move with the machine's load; the CPU does, somewhat (docs/isolation.md,
"Cost").
"""

from __future__ import annotations

import json
import os
import sys

import psutil

import yrdask as yr
from benchmarks import workloads
from benchmarks.common import CpuMeter


def _group(path: str) -> str:
    if "/yrdask/" in path:
        return "yrdask"
    if "/distributed/" in path or "/tornado/" in path:
        return "dask"
    if "/asyncio/" in path:
        return "asyncio"
    return "other"


def main(n: int = 5000, light: bool = False, top: int = 0) -> dict:
    yr.init(yr.Config(num_cpus=2))
    try:
        opts = yr.InvokeOptions(cpu=0, memory=0, light=light)
        h = yr.instance(workloads.CallProbe).options(opts).invoke()
        for _ in range(300):
            yr.get(h.inc.invoke(1))
        meter = CpuMeter([psutil.Process(yr.get(h.pid.invoke()))])
        meter.idle()
        for _ in range(n):
            yr.get(h.inc.invoke(1))
        cpu_us = next(iter(meter.per_item(n).values()))
        yr.get(h.profile.invoke(True))
        for _ in range(n):
            yr.get(h.inc.invoke(1))
        counts = yr.get(h.profile.invoke(False))
        groups = {"all": 0, "yrdask": 0, "dask": 0, "asyncio": 0}
        for (path, _name), c in counts.items():
            groups["all"] += c
            g = _group(path)
            if g in groups:
                groups[g] += c
        out = {"kind": "light" if light else "process", "calls": n,
               "yrdask": os.path.dirname(os.path.dirname(yr.__file__)),
               "cpu_us_per_call": round(cpu_us, 1),
               **{f"py_{k}": round(v / n, 2) for k, v in groups.items()}}
        if top:
            most = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
            out["top"] = [f"{c / n:.2f} {path.rsplit('/', 2)[-2:]} {name}"
                          for (path, name), c in most]
        return out
    finally:
        yr.finalize()


if __name__ == "__main__":
    args = sys.argv[1:]
    k = 0
    if "--top" in args:
        i = args.index("--top")
        k = int(args[i + 1])
        del args[i:i + 2]
    is_light = "--light" in args
    print(json.dumps(main(*(int(a) for a in args if a != "--light"), light=is_light, top=k),
                     indent=1 if k else None))
