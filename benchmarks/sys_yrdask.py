"""yrdask: the embedded cluster of ``yr.init(yr.Config(num_cpus=2))``."""

from __future__ import annotations

import time

from benchmarks.common import latency_result, payload, put_get_result, same_size
from benchmarks.registry import N_WORKERS, System, measures


def _define():
    """The remote functions (defined once yrdask is imported, i.e. inside the timed init)."""
    import yrdask as yr

    @yr.invoke
    def inc(i):
        return i + 1

    @yr.invoke
    def nested(warmup, calls):
        import statistics
        import time

        for i in range(warmup):
            yr.get(inc.invoke(i))
        out = []
        for i in range(calls):
            t = time.perf_counter()
            yr.get(inc.invoke(i))
            out.append((time.perf_counter() - t) * 1000.0)
        return statistics.median(out)

    return yr, inc, nested


class Yrdask(System):
    name = "yrdask"

    def start(self) -> None:
        self.yr, self.inc, self.nested = _define()
        self.yr.init(self.yr.Config(num_cpus=N_WORKERS))

    def trivial_call(self):
        return self.yr.get(self.inc.invoke(0))

    def stop(self) -> None:
        self.yr.finalize()

    @measures("task_rtt_ms")
    def task_rtt(self, p: dict):
        from benchmarks.common import timed_calls

        yr, inc = self.yr, self.inc
        return latency_result(timed_calls(lambda i: yr.get(inc.invoke(i)),
                                          p["warmup"], p["calls"], p.get("max_seconds")))

    @measures("tasks_10k_per_s")
    def tasks(self, p: dict):
        yr, inc = self.yr, self.inc
        yr.get([inc.invoke(i) for i in range(p["warmup"])])
        n = p["tasks"]
        t = time.perf_counter()
        refs = [inc.invoke(i) for i in range(n)]
        submitted = time.perf_counter() - t
        out = yr.get(refs)
        dt = time.perf_counter() - t
        assert out[-1] == n
        return n / dt, {"tasks": n, "seconds": dt, "submit_seconds": submitted}

    @measures("put_get_100mb_mb_per_s")
    def put_get(self, p: dict):
        yr = self.yr
        arr, kind = payload(p["size_mb"])
        secs = []
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            ref = yr.put(arr)
            out = yr.get(ref)
            dt = time.perf_counter() - t
            assert same_size(arr, out)
            same = out is arr
            del ref, out
            if k >= p["warmup"]:
                secs.append(dt)
        value, extra = put_get_result(secs, p["size_mb"], kind)
        extra["get_returned_same_object"] = same  # True: no copy was made at all
        return value, extra

    @measures("nested_task_ms")
    def nested_calls(self, p: dict):
        ms = self.yr.get(self.nested.invoke(p["warmup"], p["calls"]))
        return ms, {"calls": p["calls"]}


SYSTEM = Yrdask()
