"""Ray: ``ray.init(num_cpus=2)`` (measured only when ``import ray`` works)."""

from __future__ import annotations

import time

from benchmarks.common import latency_result, payload, put_get_result, same_size, timed_calls
from benchmarks.registry import N_WORKERS, System, measures


def _define():
    import ray

    @ray.remote
    def inc(i):
        return i + 1

    @ray.remote
    def nested(warmup, calls):
        import statistics
        import time

        for i in range(warmup):
            ray.get(inc.remote(i))
        out = []
        for i in range(calls):
            t = time.perf_counter()
            ray.get(inc.remote(i))
            out.append((time.perf_counter() - t) * 1000.0)
        return statistics.median(out)

    return ray, inc, nested


class Ray(System):
    name = "ray"
    requires = "ray"
    install_hint = "pip install -e .[bench]"

    def start(self) -> None:
        self.ray, self.inc, self.nested = _define()
        self.ray.init(num_cpus=N_WORKERS)

    def trivial_call(self):
        return self.ray.get(self.inc.remote(0))

    def stop(self) -> None:
        self.ray.shutdown()

    @measures("task_rtt_ms")
    def task_rtt(self, p: dict):
        ray, inc = self.ray, self.inc
        return latency_result(timed_calls(lambda i: ray.get(inc.remote(i)),
                                          p["warmup"], p["calls"], p.get("max_seconds")))

    @measures("tasks_10k_per_s")
    def tasks(self, p: dict):
        ray, inc = self.ray, self.inc
        ray.get([inc.remote(i) for i in range(p["warmup"])])
        n = p["tasks"]
        t = time.perf_counter()
        refs = [inc.remote(i) for i in range(n)]
        submitted = time.perf_counter() - t
        out = ray.get(refs)
        dt = time.perf_counter() - t
        assert out[-1] == n
        return n / dt, {"tasks": n, "seconds": dt, "submit_seconds": submitted}

    @measures("put_get_100mb_mb_per_s")
    def put_get(self, p: dict):
        ray = self.ray
        arr, kind = payload(p["size_mb"])
        secs = []
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            ref = ray.put(arr)
            out = ray.get(ref)
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
        ms = self.ray.get(self.nested.remote(p["warmup"], p["calls"]))
        return ms, {"calls": p["calls"]}


SYSTEM = Ray()
