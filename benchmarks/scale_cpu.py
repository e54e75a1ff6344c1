"""``python -m benchmarks.scale_cpu N [TASKS]``: where the CPU of a task burst goes, N workers.

``scale_tasks_per_s`` (TASKS empty tasks submitted, then gathered) on an embedded cluster of N
worker processes, with the CPU each process spent per task and, in the driver (which also
hosts the scheduler), each thread's.  A driver thread near its wall time per task is the
bottleneck; workers far below it are waiting for work.  Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import psutil

import yrdask as yr


@yr.invoke
def empty(i):
    return i


def _threads(proc: psutil.Process) -> dict[str, float]:
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {f"{names.get(t.id, t.id)}": t.user_time + t.system_time for t in proc.threads()}


def _procs(me: psutil.Process) -> dict[int, tuple[str, float]]:
    out = {}
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.cmdline())[-50:], t.user + t.system)
        except psutil.Error:
            pass
    return out


def main(cpus: int, tasks: int) -> dict:
    t0 = time.perf_counter()
    yr.init(yr.Config(num_cpus=cpus))
    yr.get(empty.invoke(0))
    init_s = time.perf_counter() - t0
    yr.get([empty.invoke(i) for i in range(2000)])  # warm every worker and lease
    me = psutil.Process()
    procs0, threads0 = _procs(me), _threads(me)
    t = time.perf_counter()
    refs = [empty.invoke(i) for i in range(tasks)]
    submitted = time.perf_counter() - t
    yr.get(refs)
    wall = time.perf_counter() - t
    procs1, threads1 = _procs(me), _threads(me)
    per = 1e6 / tasks
    workers = sorted((procs1[p][1] - procs0[p][1]) * per for p in procs1 if p in procs0 and p != me.pid)
    out = {
        "cpus": cpus, "tasks": tasks, "init_s": round(init_s, 3),
        "tasks_per_s": round(tasks / wall), "submit_us_per_task": round(submitted * per, 1),
        "wall_us_per_task": round(wall * per, 1),
        "driver_us_per_task": round((procs1[me.pid][1] - procs0[me.pid][1]) * per, 1),
        "driver_threads_us_per_task": {k: round((v - threads0.get(k, 0.0)) * per, 1)
                                       for k, v in threads1.items()
                                       if (v - threads0.get(k, 0.0)) * per >= 0.5},
        "other_processes_us_per_task": [round(w, 1) for w in workers],
    }
    yr.finalize()
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20000)))
