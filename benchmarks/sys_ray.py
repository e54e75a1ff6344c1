"""Ray: ``ray.init(num_cpus=2)`` (measured only when ``import ray`` works)."""

from __future__ import annotations

from benchmarks.registry import N_WORKERS, System


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
        self.ray, self.inc, self.nested_fn = _define()
        self.ray.init(num_cpus=N_WORKERS)

    def stop(self) -> None:
        self.ray.shutdown()

    def submit(self, i: int):
        return self.inc.remote(i)

    def gather(self, handles: list) -> list:
        return self.ray.get(handles)

    def put(self, obj):
        return self.ray.put(obj)

    def fetch(self, handle):
        return self.ray.get(handle)

    def nested(self, warmup: int, calls: int) -> float:
        return self.ray.get(self.nested_fn.remote(warmup, calls))


SYSTEM = Ray()
