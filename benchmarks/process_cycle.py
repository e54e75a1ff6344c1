"""``python -m benchmarks.process_cycle [N] [--light]``: the CPU one instance's life costs,
back to back, in each process of the embedded 2-CPU cluster.

N (default 100) cycles of: create an instance (a process instance, or a light one with
``--light``), call it once, ``terminate()`` it (what ``process_create_ms`` repeats), after 5
warm-up cycles. Prints one JSON line: the wall time a cycle took, and the CPU per cycle in
ms of the driver (with the embedded scheduler), each worker process, each zygote and the
instances' own processes (the zygote's reaped children), and their total, and the minor page
faults per cycle of the zygotes and of the instances' processes (nearly all of them copies
on write: ``python -m benchmarks.fork_floor`` gives what each costs here). On two cores a
loop of cycles cannot take less than about half its total CPU (docs/isolation.md, "What a
creation still costs"). To measure another checkout, run it from outside a worktree's root
with a folder holding this ``benchmarks`` first on ``PYTHONPATH`` and that checkout's root
after it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil

import yrdask as yr
from benchmarks import workloads


def _cpu(p: psutil.Process) -> tuple[float, float]:
    """(its own CPU seconds, its reaped children's)."""
    t = p.cpu_times()
    return t.user + t.system, t.children_user + t.children_system


def _faults(p: psutil.Process) -> tuple[int, int]:
    """(its own minor faults, its reaped children's): ``/proc/PID/stat``'s minflt, cminflt."""
    with open(f"/proc/{p.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[8])


def _role(p: psutil.Process, driver: int) -> str:
    if p.pid == driver:
        return "driver"
    line = " ".join(p.cmdline())
    if "--zygote" in line:
        return "zygote"
    return "worker" if p.name().startswith("dask worker") or "worker" in p.name() else "other"


def main(n: int = 100, light: bool = False) -> dict:
    yr.init(yr.Config(num_cpus=2))
    try:
        counter = yr.instance(workloads.Counter).options(
            yr.InvokeOptions(cpu=0, memory=0, light=light))

        def cycle(k: int) -> None:
            h = counter.invoke()
            assert yr.get(h.inc.invoke(k)) == k + 1
            h.terminate()

        for k in range(5):
            cycle(k)
        time.sleep(0.5)  # the last stop and the next spare's start are done
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        before = {p.pid: _cpu(p) for p in procs}
        forked = [p for p in procs if _role(p, me.pid) == "zygote"]  # spares look alike
        zygotes = [p for p in forked if p.ppid() not in {z.pid for z in forked}]
        faults_before = {p.pid: _faults(p) for p in zygotes}
        t = time.perf_counter()
        for k in range(n):
            cycle(k)
        wall = time.perf_counter() - t
        time.sleep(0.5)  # the last stop's exit is reaped
        faults = {"zygote": 0, "instances": 0}
        for p in zygotes:
            own, reaped = _faults(p)
            faults["zygote"] += own - faults_before[p.pid][0]
            faults["instances"] += reaped - faults_before[p.pid][1]
        out: dict = {"driver": 0.0, "worker": 0.0, "zygote": 0.0, "instances": 0.0,
                     "other": 0.0}
        for p in procs:
            try:
                own, reaped = _cpu(p)
            except psutil.Error:
                continue
            role = _role(p, me.pid)
            out[role] += (own - before[p.pid][0]) / n * 1e3
            if role == "zygote":  # its children are the instances' processes (and spares)
                out["instances"] += (reaped - before[p.pid][1]) / n * 1e3
        return {"kind": "light" if light else "process", "cycles": n,
                "yrdask": os.path.dirname(os.path.dirname(yr.__file__)),
                "wall_ms_per_cycle": round(wall / n * 1e3, 2),
                "cpu_ms_per_cycle": {k: round(v, 2) for k, v in out.items()},
                "cpu_ms_total": round(sum(out.values()), 2),
                "minor_faults_per_cycle": {k: round(v / n) for k, v in faults.items()}}
    finally:
        yr.finalize()


if __name__ == "__main__":
    args = sys.argv[1:]
    light = "--light" in args
    numbers = [a for a in args if a.isdigit()]
    print(json.dumps(main(int(numbers[0]) if numbers else 100, light)))
