"""Helpers shared by the system modules: timing, medians, memory and payloads."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import psutil


def timed_calls(call: Callable[[int], object], warmup: int, calls: int,
                max_seconds: float | None = None, min_calls: int = 200) -> list[float]:
    """Run ``call(i)`` ``warmup`` times untimed, then ``calls`` times; seconds per call.

    With ``max_seconds``, stop early once that much time went into timed calls and at least
    ``min_calls`` were made (keeps slow systems from dominating the run time).
    """
    for i in range(warmup):
        call(i)
    out = []
    pc = time.perf_counter
    start = pc()
    for i in range(calls):
        t = pc()
        call(i)
        out.append(pc() - t)
        if max_seconds is not None and len(out) >= min_calls and pc() - start > max_seconds:
            break
    return out


def latency_result(secs: list[float]) -> tuple[float, dict]:
    ms = sorted(s * 1000.0 for s in secs)
    n = len(ms)
    return statistics.median(ms), {"calls": n, "p10_ms": ms[n // 10],
                                   "p90_ms": ms[(9 * n) // 10], "mean_ms": sum(ms) / n}


def tree_pss_mb() -> tuple[float, dict]:
    """PSS of this process and all its descendants (RSS for any whose PSS is unreadable)."""
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    total = 0
    fallback = 0
    counted = 0
    for p in procs:
        try:
            try:
                total += p.memory_full_info().pss
            except (psutil.AccessDenied, AttributeError):
                total += p.memory_info().rss
                fallback += 1
            counted += 1
        except psutil.NoSuchProcess:
            pass
    return total / 1e6, {"processes": counted, "rss_fallbacks": fallback}


def payload(size_mb: int):
    """A ``size_mb`` MB (10**6 bytes) numpy uint8 array, or bytes without numpy."""
    n = size_mb * 10**6
    try:
        import numpy as np
    except ImportError:
        return b"\x01" * n, "bytes"
    return np.ones(n, dtype=np.uint8), "numpy"


def same_size(a, b) -> bool:
    return getattr(a, "nbytes", None) == getattr(b, "nbytes", None) if hasattr(a, "nbytes") \
        else len(a) == len(memoryview(b).cast("B"))


def put_get_result(secs: list[float], size_mb: int, kind: str) -> tuple[float, dict]:
    med = statistics.median(secs)
    return 2 * size_mb / med, {"repeats": len(secs), "median_s": med, "payload": kind,
                               "runs_mb_per_s": [2 * size_mb / s for s in secs]}


class CpuMeter:
    """CPU seconds per process of a cluster, net of each process's idle rate.

    :meth:`idle` reads every process's CPU rate over ``seconds`` of doing nothing (Dask's
    periodic callbacks), :meth:`start` / :meth:`per_item` then give the CPU per item of the
    work in between, with that idle rate over its wall time subtracted, in µs per pid."""

    def __init__(self, procs: list[psutil.Process]) -> None:
        self.procs = procs
        self.rates: dict[int, float] = {}
        self.begun: tuple[dict[int, float], float] = ({}, 0.0)

    def snap(self) -> tuple[dict[int, float], float]:
        out = {}
        for p in self.procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out, time.perf_counter()

    def idle(self, seconds: float = 1.5) -> None:
        a, ta = self.snap()
        time.sleep(seconds)
        b, tb = self.snap()
        self.rates = {pid: (b[pid] - a[pid]) / (tb - ta) for pid in a if pid in b}
        self.begun = (b, tb)

    def start(self) -> None:
        self.begun = self.snap()

    def per_item(self, n: int) -> dict[int, float]:
        (b, tb), (c, tc) = self.begun, self.snap()
        return {pid: ((c[pid] - b[pid]) - rate * (tc - tb)) / n * 1e6
                for pid, rate in self.rates.items() if pid in c and pid in b}
