"""``python -m benchmarks.scale_cpu N [TASKS] [--processes]``: where the CPU of a task burst
goes, N workers.

``scale_tasks_per_s`` (TASKS empty tasks submitted, then gathered) on an embedded cluster of N
worker processes, with the CPU each process spent per task and, in the driver (which also
hosts the scheduler), each thread's.  A driver thread near its wall time per task is the
bottleneck; workers far below it are waiting for work.  ``messages`` counts the driver's TCP
reads and writes during the burst and the messages they carried (the call channels'
``RUN_TASK`` out and ``TASK_DONE`` in, plus a few scheduler messages), and ``epoll_ops_per_read``
the driver's selector registrations changed per read (tornado drops a socket's read interest
when a read leaves bytes in its buffer and adds it back when the buffer empties: two
``epoll_ctl`` calls per read of a message that arrived whole).  Prints one JSON line.

``--processes``: start N worker processes even where the machine has fewer cores (the
embedded cluster starts one per core; this sets Dask's core count in this benchmark process
only).  Wall figures then mean little; CPU per task per process and messages per task are
what to compare.

``--pin``: the driver (and the scheduler) on the first core, the workers on the others:
on a small machine the workers then answer as fast as on one with a core per worker, and
the driver's loop is the bottleneck, as on 16 cores (messages per read and write then
follow the pipelining and batching rules, not the shortage of CPU).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import selectors

import dask.system
import psutil
from distributed.comm.tcp import TCP

import yrdask as yr

_counts = {"reads": 0, "msgs_in": 0, "writes": 0, "msgs_out": 0, "epoll_ops": 0}


def _count_messages() -> None:
    """Count the driver's TCP reads and writes and the messages in them (this process)."""
    read, write = TCP.read, TCP.write

    async def counted_read(self, *args, **kwargs):
        msgs = await read(self, *args, **kwargs)
        _counts["reads"] += 1
        _counts["msgs_in"] += len(msgs) if isinstance(msgs, (list, tuple)) else 1
        return msgs

    async def counted_write(self, msg, *args, **kwargs):
        _counts["writes"] += 1
        _counts["msgs_out"] += len(msg) if isinstance(msg, (list, tuple)) else 1
        return await write(self, msg, *args, **kwargs)

    TCP.read, TCP.write = counted_read, counted_write

    sel = selectors.DefaultSelector
    for name in ("register", "unregister", "modify"):
        def counted(self, *args, _op=getattr(sel, name), **kwargs):
            _counts["epoll_ops"] += 1
            return _op(self, *args, **kwargs)

        setattr(sel, name, counted)


@yr.invoke
def empty(i):
    return i


def _threads(proc: psutil.Process) -> dict[str, float]:
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {f"{names.get(t.id, t.id)}": t.user_time + t.system_time for t in proc.threads()}


def _procs(me: psutil.Process) -> dict[int, tuple[str, float, int]]:
    out = {}
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            c = p.num_ctx_switches()
            out[p.pid] = (" ".join(p.cmdline())[-50:], t.user + t.system,
                          c.voluntary + c.involuntary)
        except psutil.Error:
            pass
    return out


def _pin(me: psutil.Process) -> None:
    """``--pin``: this process (the driver and the scheduler) on the first core, every worker
    process on the others, so the workers have CPU to spare as on a machine with a core per
    worker, and the driver's loop sets the pace."""
    cores = me.cpu_affinity()
    if len(cores) < 2:
        raise SystemExit("--pin needs at least 2 cores")
    me.cpu_affinity(cores[:1])
    for child in me.children(recursive=True):
        try:
            child.cpu_affinity(cores[1:])
        except psutil.Error:
            pass


def main(cpus: int, tasks: int, pin: bool = False) -> dict:
    t0 = time.perf_counter()
    yr.init(yr.Config(num_cpus=cpus))
    yr.get(empty.invoke(0))
    init_s = time.perf_counter() - t0
    me = psutil.Process()
    if pin:
        _pin(me)
    yr.get([empty.invoke(i) for i in range(2000)])  # warm every worker and lease
    procs0, threads0 = _procs(me), _threads(me)
    _counts.update(dict.fromkeys(_counts, 0))
    t = time.perf_counter()
    refs = [empty.invoke(i) for i in range(tasks)]
    submitted = time.perf_counter() - t
    yr.get(refs)
    wall = time.perf_counter() - t
    procs1, threads1 = _procs(me), _threads(me)
    counts = dict(_counts)
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
        "context_switches_per_task": {
            "driver": round((procs1[me.pid][2] - procs0[me.pid][2]) / tasks, 2),
            "other_processes": round(sum(procs1[p][2] - procs0[p][2] for p in procs1
                                         if p in procs0 and p != me.pid) / tasks, 2)},
        "messages": {
            "in_per_task": round(counts["msgs_in"] / tasks, 2),
            "in_per_read": round(counts["msgs_in"] / max(1, counts["reads"]), 2),
            "out_per_task": round(counts["msgs_out"] / tasks, 2),
            "out_per_write": round(counts["msgs_out"] / max(1, counts["writes"]), 2),
            "epoll_ops_per_read": round(counts["epoll_ops"] / max(1, counts["reads"]), 2)},
    }
    yr.finalize()
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--processes" in sys.argv:
        dask.system.CPU_COUNT = int(args[0])  # worker_layout: one process per "core"
    _count_messages()
    print(json.dumps(main(int(args[0]), int(args[1]) if len(args) > 1 else 20000,
                          pin="--pin" in sys.argv)))
