"""The figure catalogue: what each benchmark figure measures, its unit and its parameters.

``params`` are the full-run parameters; ``quick`` overrides them for ``--quick`` (smoke runs).
Groups let ``--only`` select several figures at once (``--only stateless``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Figure:
    name: str
    group: str
    unit: str
    higher_is_better: bool
    description: str
    params: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0

    def parameters(self, quick: bool) -> dict[str, Any]:
        p = dict(self.params)
        if quick:
            p.update(self.quick)
        return p


FIGURES: dict[str, Figure] = {}


def add(fig: Figure) -> Figure:
    if fig.name in FIGURES:
        raise ValueError(f"figure {fig.name!r} defined twice")
    FIGURES[fig.name] = fig
    return fig


add(Figure(
    "init_s", "stateless", "s", False,
    "import + init of a 2-worker-process cluster until the first trivial task's result is back, "
    "timed from the first line of a fresh interpreter (before the library is imported)",
))
add(Figure(
    "idle_pss_mb", "stateless", "MB", False,
    "total PSS (RSS where PSS is unreadable) of the driver and all its descendant processes, "
    "after init and one trivial call, idle",
    params={"settle_s": 1.0}, quick={"settle_s": 0.5},
))
add(Figure(
    "task_rtt_ms", "stateless", "ms", False,
    "sequential get(f.invoke(i)) round trip of a trivial task: median per call over 2000 calls "
    "(or as many as fit in 10 s, at least 200) after 100 warm-up calls",
    params={"warmup": 100, "calls": 2000, "max_seconds": 10.0},
    quick={"warmup": 10, "calls": 100, "max_seconds": 5.0},
))
add(Figure(
    "tasks_10k_per_s", "stateless", "tasks/s", True,
    "N trivial tasks submitted, then all gathered with one get(list): N / seconds",
    params={"tasks": 10_000, "warmup": 100}, quick={"tasks": 1_000, "warmup": 20},
))
add(Figure(
    "put_get_100mb_mb_per_s", "stateless", "MB/s", True,
    "a 100 MB numpy array put, then get in the driver: 200 MB / seconds (both directions "
    "counted, Ray's benchmark convention); median over repeats",
    params={"size_mb": 100, "warmup": 1, "repeats": 5}, quick={"warmup": 1, "repeats": 2},
))
add(Figure(
    "nested_task_ms", "stateless", "ms", False,
    "inside one task, sequential nested get(g.invoke(i)) round trips: median per call",
    params={"warmup": 20, "calls": 200}, quick={"warmup": 5, "calls": 50},
))


def select(only: str | None) -> list[Figure]:
    """Figures named (or whose group is named) in the comma-separated ``only``; all if None."""
    if not only:
        return list(FIGURES.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    chosen: list[Figure] = []
    for n in names:
        if n in FIGURES:
            hits = [FIGURES[n]]
        else:
            hits = [f for f in FIGURES.values() if f.group == n]
        if not hits:
            known = ", ".join(list(FIGURES) + sorted({f.group for f in FIGURES.values()}))
            raise SystemExit(f"unknown figure or group {n!r}; known: {known}")
        chosen += [f for f in hits if f not in chosen]
    return chosen
