"""yrdask: the embedded cluster of ``yr.init(yr.Config(num_cpus=2))``."""

from __future__ import annotations

from benchmarks.registry import N_WORKERS, System


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
        self.yr, self.inc, self.nested_fn = _define()
        self.yr.init(self.yr.Config(num_cpus=N_WORKERS))

    def stop(self) -> None:
        self.yr.finalize()

    def submit(self, i: int):
        return self.inc.invoke(i)

    def gather(self, handles: list) -> list:
        return self.yr.get(handles)

    def put(self, obj):
        return self.yr.put(obj)

    def fetch(self, handle):
        return self.yr.get(handle)

    def nested(self, warmup: int, calls: int) -> float:
        return self.yr.get(self.nested_fn.invoke(warmup, calls))


SYSTEM = Yrdask()
