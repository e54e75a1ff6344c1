"""Systems under test and the ``@measures`` decorator that maps figures to their methods.

A :class:`System` knows how to start a 2-worker-process cluster, run one trivial call and stop;
each figure is a method decorated with ``@measures("figure_name")`` that takes the figure's
parameters and returns ``(value, extra)`` -- ``extra`` is a dict of details kept in the JSON.
``init_s`` and ``idle_pss_mb`` are measured by the harness (:mod:`benchmarks._one`) for every
system from ``start`` and ``trivial_call``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

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

    def trivial_call(self) -> Any:  # one trivial task, waited for
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

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
