"""The user code the figures run on the workers, written once as plain Python.

Each system module wraps these in its own API (``yr.invoke(inc)``,
``yr.instance(invoke_options=...)(Counter)``, ``ray.remote(Counter)``, ``client.submit(inc)``)
and passes its own submit and get to the nested bodies.  Defined at module level, they are
pickled by reference: the worker processes import ``benchmarks.workloads``, which
:func:`benchmarks.run.child_env` puts on their ``PYTHONPATH``.  Only code whose body depends
on the system's API (the seed's supervisor, ``nbytes_of``) stays in the system modules.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable


def inc(i):
    return i + 1


def whoami(i):
    return os.getpid()


def spin(ms):
    """Busy CPU for ``ms`` milliseconds (holds the GIL, as pure-Python work does)."""
    end = time.perf_counter() + ms / 1000.0
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def blas_matmul(n: int, times: int) -> dict:
    """A 2-CPU task's BLAS-bound work: ``times`` products of two ``n``×``n`` float64
    matrices (after one to warm up), the seconds they took inside the task, and what ran
    them: BLAS threads and kernel (threadpoolctl) and ``OMP_NUM_THREADS``."""
    import numpy as np
    from threadpoolctl import threadpool_info

    rng = np.random.default_rng(0)
    a, b = rng.random((n, n)), rng.random((n, n))
    a @ b
    t = time.perf_counter()
    for _ in range(times):
        a @ b
    dt = time.perf_counter() - t
    blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
    return {"seconds": dt, "blas_threads": max((i["num_threads"] for i in blas), default=0),
            "kernel": ",".join(f"{i['internal_api']}:{i.get('architecture')}" for i in blas),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def fan_out(children: int, ms: float, *, submit_spin: Callable[[float], Any],
            get: Callable[[list], list]) -> int:
    """Inside a task: ``children`` tasks of ``ms`` ms CPU each, gathered (nested fan-out)."""
    return len(get([submit_spin(ms) for _ in range(children)]))


def _same_process_fraction(pids: list[int]) -> float:
    me = os.getpid()
    return sum(p == me for p in pids) / len(pids)


def nested_rtt(warmup: int, calls: int, *, submit_inc: Callable[[int], Any],
               submit_whoami: Callable[[int], Any], get: Callable[[Any], Any],
               get_one: Callable[[Any], Any] | None = None) -> dict:
    """Inside one task: sequential ``get_one(submit_inc(i))`` round trips, median in ms.

    ``get`` gathers a list of handles; ``get_one`` (default ``get``) waits for one.  Also
    reports the fraction of 20 inner tasks that ran in this task's own process.
    """
    get_one = get_one or get
    for i in range(warmup):
        get_one(submit_inc(i))
    out = []
    pc = time.perf_counter
    for i in range(calls):
        t = pc()
        get_one(submit_inc(i))
        out.append((pc() - t) * 1000.0)
    pids = get([submit_whoami(i) for i in range(20)])
    import statistics  # here, not at the top: a process instance of this module's Counter
    # would import it (fractions, decimal) on its way to its first call, ~3 MB and ms each

    return {"median_ms": statistics.median(out),
            "inner_same_process_fraction": _same_process_fraction(pids)}


def nested_burst(warmup: int, n: int, *, submit_inc: Callable[[int], Any],
                 submit_whoami: Callable[[int], Any], get: Callable[[list], list]) -> dict:
    """Inside one task: ``n`` trivial tasks submitted, then gathered with one ``get``."""
    get([submit_inc(i) for i in range(warmup)])
    t = time.perf_counter()
    out = get([submit_whoami(i) for i in range(n)])
    dt = time.perf_counter() - t
    return {"seconds": dt, "inner_same_process_fraction": _same_process_fraction(out)}


class Counter:
    def __init__(self):
        self.n = 0

    def inc(self, i):
        self.n += 1
        return i + 1

    def pid(self):
        return os.getpid()

    def checkpoint(self):
        import yrdask

        yrdask.save_state()
        return self.n


class CallProbe(Counter):
    """A counter that counts the Python calls its process runs on the thread that runs its
    calls and on the process's event loop thread (``benchmarks/process_calls.py``)."""

    def profile(self, on: bool) -> dict | None:
        """Start counting (``on``) in this thread and on the loop thread, or stop and
        return the counts, ``{(file, function): calls}``."""
        import sys
        import threading

        from yrdask.runtime.context import installed_runtime

        rt = installed_runtime()
        loop = rt.__dict__.get("_loop") or rt.loop  # a process's runtime may not be started
        if not on:
            sys.setprofile(None)
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: (sys.setprofile(None), done.set()))
            done.wait(10)
            return self.counts
        counts: dict = {}
        self.counts = counts

        def count(frame, event, _arg):
            if event == "call":
                code = frame.f_code
                key = (code.co_filename, code.co_name)
                counts[key] = counts.get(key, 0) + 1

        loop.call_soon_threadsafe(sys.setprofile, count)
        sys.setprofile(count)
        return None


class TrainingWorker:
    """The seed's (examples/training_tree.py) worker, without its sleep."""

    def train(self, shard_id, hyperparams):
        return f"Loss: {0.1 / hyperparams['lr']}"
