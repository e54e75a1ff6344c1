"""Scheduling figures the global scheduler keeps for the dashboard, ``/metrics`` and benchmarks.

Placement latency is measured from the moment a lease or instance request reaches the
scheduler to the moment it holds resources (or gives up), per request kind.  Local vs
forwarded work is counted where it is decided: leases here (``counters`` of the extension),
tasks in each worker's submitter (reported with the Dask heartbeat, ``ws.metrics["yr"]``).
"""

from __future__ import annotations

from collections import deque


class SchedulingFigures:
    """Counts and recent latencies of placements, by kind ("lease" / "instance")."""

    def __init__(self, keep: int = 1000) -> None:
        self.count: dict[str, int] = {}
        self.total_s: dict[str, float] = {}
        self.recent: dict[str, deque] = {}
        self.keep = keep

    def placed(self, kind: str, seconds: float) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        self.total_s[kind] = self.total_s.get(kind, 0.0) + seconds
        self.recent.setdefault(kind, deque(maxlen=self.keep)).append(seconds)

    def snapshot(self) -> dict:
        """``{kind: {"count", "mean_ms", "p50_ms", "p99_ms"}}`` (percentiles of recent ones)."""
        out = {}
        for kind, n in self.count.items():
            recent = sorted(self.recent[kind])
            out[kind] = {
                "count": n,
                "mean_ms": 1000 * self.total_s[kind] / n,
                "p50_ms": 1000 * recent[len(recent) // 2],
                "p99_ms": 1000 * recent[min(len(recent) - 1, int(len(recent) * 0.99))],
            }
        return out
