"""``python -m benchmarks.fork_floor [--pages N] [--forks N]``: what this machine charges for
the two things every process instance costs whatever yrdask does, in a process with the
zygote's imports (:func:`yrdask.worker.isolated.zygote.warm`).

* ``cow_fault_us``: the CPU of one copy-on-write fault: a child writes one byte to each of
  ``--pages`` pages it shares with its parent (each write is a minor fault and a page copy,
  as a child's first write to a shared Python object is).
* ``fork_exit_ms``: the CPU of a fork and an exit, the parent's and the child's, for a child
  that exits at once (page tables copied, then torn down).

With the faults an instance's process takes a cycle (``minor_faults_per_cycle`` of ``python
-m benchmarks.process_cycle``), these give the least CPU a process instance's life can cost
here (docs/isolation.md, "Cost").  Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys

PAGE = os.sysconf("SC_PAGE_SIZE")


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _child_cow(buf: bytearray, pages: int, report: int) -> None:
    """In the child: write to ``pages`` shared pages, send (CPU s, minor faults), exit."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(pages):
        buf[i * PAGE] = 2
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    os.write(report, json.dumps([cpu, r1.ru_minflt - r0.ru_minflt]).encode())
    os._exit(0)


def main(pages: int = 2000, forks: int = 100) -> dict:
    from yrdask.worker.isolated.zygote import warm

    warm()
    with open("/proc/self/statm") as f:
        rss_mb = int(f.read().split()[1]) * PAGE / 1e6

    before = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    fork_exit = (_cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - before) / forks

    buf = bytearray(pages * PAGE)
    for i in range(pages):  # the parent's own pages, not the zero page
        buf[i * PAGE] = 1
    runs = []
    for _ in range(5):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child_cow(buf, pages, w)
        os.close(w)
        runs.append(json.loads(os.read(r, 256)))
        os.close(r)
        os.waitpid(pid, 0)
    runs.sort()
    cpu, faults = runs[len(runs) // 2]
    return {"zygote_rss_mb": round(rss_mb, 1), "forks": forks, "pages": pages,
            "fork_exit_ms": round(fork_exit * 1e3, 3),
            "cow_faults": faults, "cow_fault_us": round(cpu / pages * 1e6, 2),
            "cow_fault_us_runs": [round(c / pages * 1e6, 2) for c, _ in runs]}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.fork_floor")
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--forks", type=int, default=100)
    a = ap.parse_args(sys.argv[1:])
    print(json.dumps(main(a.pages, a.forks)))
