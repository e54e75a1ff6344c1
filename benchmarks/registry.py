"""Systems under test and the ``@measures`` decorator that maps figures to their methods.

A :class:`System` knows how to start a 2-worker-process cluster, run one trivial call and stop;
each figure is a method decorated with ``@measures("figure_name")`` that takes the figure's
parameters and returns ``(value, extra)`` -- ``extra`` is a dict of details kept in the JSON.
``init_s`` and ``idle_pss_mb`` are measured by the harness (:mod:`benchmarks._one`) for every
system from ``start`` and ``trivial_call``.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

from benchmarks.common import latency_result, payload, put_get_result, same_size, timed_calls

#: system name -> module that defines ``SYSTEM`` (a System subclass instance)
SYSTEM_MODULES = {
    "yrdask": "benchmarks.sys_yrdask",
    "dask": "benchmarks.sys_dask",
    "ray": "benchmarks.sys_ray",
}
SYSTEMS = list(SYSTEM_MODULES)

N_WORKERS = 2  # the machine has 2 cores: every cluster has 2 worker processes


def measures(figure: str) -> Callable[[Callable], Callable]:
    """Mark a System method as the implementation of ``figure``."""

    def mark(fn: Callable) -> Callable:
        fn._bench_figure = figure  # type: ignore[attr-defined]
        return fn

    return mark


class System:
    """A system under test: start/stop plus a few primitives; the figures are written once here.

    A subclass implements ``start``, ``stop``, ``submit(i)`` (a trivial remote ``i + 1``,
    returning the system's handle), ``gather(handles)``, ``put(obj)``, ``fetch(handle)`` and
    ``nested(warmup, calls)`` (median ms of sequential nested calls made inside one task).
    """

    name = "?"
    #: the import that must work for the system to be measured, and the hint when it fails
    requires = ""
    install_hint = ""

    def available(self) -> str | None:
        """None when the system can run here, else why not."""
        if not self.requires:
            return None
        try:
            importlib.import_module(self.requires)
        except ImportError:
            return f"{self.name} not installed ({self.install_hint})"
        return None

    def start(self) -> None:  # import the library, start the cluster, wait until ready
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def submit(self, i: int) -> Any:
        raise NotImplementedError

    def gather(self, handles: list) -> list:
        raise NotImplementedError

    def put(self, obj: Any) -> Any:
        raise NotImplementedError

    def fetch(self, handle: Any) -> Any:
        raise NotImplementedError

    def nested(self, warmup: int, calls: int) -> float:
        raise NotImplementedError

    def trivial_call(self) -> Any:
        """One trivial task, waited for."""
        return self.gather([self.submit(0)])[0]

    # -- the figures ---------------------------------------------------------------------

    @measures("task_rtt_ms")
    def task_rtt(self, p: dict) -> tuple[float, dict]:
        return latency_result(timed_calls(lambda i: self.gather([self.submit(i)]),
                                          p["warmup"], p["calls"], p.get("max_seconds")))

    @measures("tasks_10k_per_s")
    def tasks(self, p: dict) -> tuple[float, dict]:
        self.gather([self.submit(i) for i in range(p["warmup"])])
        n = p["tasks"]
        t = time.perf_counter()
        handles = [self.submit(i) for i in range(n)]
        submitted = time.perf_counter() - t
        out = self.gather(handles)
        dt = time.perf_counter() - t
        assert out[-1] == n
        return n / dt, {"tasks": n, "seconds": dt, "submit_seconds": submitted}

    @measures("put_get_100mb_mb_per_s")
    def put_get(self, p: dict) -> tuple[float, dict]:
        arr, kind = payload(p["size_mb"])
        secs = []
        same = False
        for k in range(p["warmup"] + p["repeats"]):
            t = time.perf_counter()
            handle = self.put(arr)
            out = self.fetch(handle)
            dt = time.perf_counter() - t
            assert same_size(arr, out)
            same = out is arr
            del handle, out
            if k >= p["warmup"]:
                secs.append(dt)
        value, extra = put_get_result(secs, p["size_mb"], kind)
        extra["get_returned_same_object"] = same  # True: no copy was made at all
        return value, extra

    @measures("nested_task_ms")
    def nested_calls(self, p: dict) -> tuple[float, dict]:
        return self.nested(p["warmup"], p["calls"]), {"calls": p["calls"]}

    def figures(self) -> dict[str, Callable[[dict], tuple[float, dict]]]:
        out = {}
        for attr in dir(type(self)):
            fn = getattr(type(self), attr)
            fig = getattr(fn, "_bench_figure", None)
            if fig is not None:
                out[fig] = getattr(self, attr)
        return out


def load(name: str) -> System:
    mod = importlib.import_module(SYSTEM_MODULES[name])
    return mod.SYSTEM


def install_hint(name: str) -> str:
    """The system's unavailability message without importing the library itself."""
    return load(name).available() or ""
