"""yr work in Dask's own panels, the scheduler's half: Task Stream, Progress, time per key.

Workers send what their yr tasks and method calls did (:class:`yrdask.protocol.TaskRecords`,
from ``yrdask.worker.dask_panels``); :class:`DaskPanels` puts it where Dask's own pages and
client calls read their tasks:

* each record becomes an entry of Dask's ``TaskStreamPlugin`` buffer, read in Dask's format
  (``key`` ``"<name>-<id>"``, ``worker``, ``thread``, ``status``, ``startstops``; stored as a
  flat tuple, :class:`StreamBuffer`), so the Task Stream page colours it per function and
  ``client.get_task_stream()`` returns it;
* each name (``f``, ``Class.method``, ``Class.__init__``, and ``Class`` for instance
  lifetimes) gets a Dask ``TaskPrefix`` in ``scheduler.task_prefixes`` whose state counts
  say queued / running (``processing``) / done (``memory``) / erred; that is what the
  Progress bars and the "Compute time per key" pages read.  Done and erred counts are
  dropped (moved to ``forgotten``) once a name has had nothing queued or running for
  :data:`FADE_S`, as Dask forgets finished tasks.

yr's prefixes are its own objects: when Dask already has a prefix of that name (a Dask
function of the same name), yr's is listed as ``"<name> (yr)"``.  Nothing here touches
Dask's tasks.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Iterable, Mapping, Sequence

FADE_S = 60.0  # done/erred counts stay on Progress this long after a name's last activity
LIVE = ("processing", "queued")


class DaskPanels:
    """Feeds yr's records into Dask's Task Stream buffer and task prefixes (module doc)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.prefixes: dict[str, Any] = {}  # name -> yr's TaskPrefix
        self.counts: dict[str, tuple[dict[str, int], dict[str, int]]] = {}  # worker -> now
        self.active_at: dict[str, float] = {}  # name -> last time something happened
        self.classes: set[str] = set()  # names whose counts are instance lifetimes
        self.records = 0  # records added so far
        self.tasks: dict[str, Any] = {}  # worker -> its tasks now (TaskRecords.tasks)

    # -- Dask's objects --------------------------------------------------------------------

    def task_stream(self) -> Any:
        """Dask's TaskStreamPlugin on this scheduler (added as Dask's dashboard does), its
        buffer made a :class:`StreamBuffer`."""
        from distributed.diagnostics.task_stream import TaskStreamPlugin

        plugin = self.scheduler.plugins.get(TaskStreamPlugin.name)
        if plugin is None:
            plugin = TaskStreamPlugin(self.scheduler)
            self.scheduler.add_plugin(plugin)
        if type(plugin.buffer) is not StreamBuffer:
            plugin.buffer = StreamBuffer(plugin.buffer, plugin.buffer.maxlen)
        return plugin

    def prefix(self, name: str) -> Any:
        """yr's TaskPrefix for ``name``, (re)listed in ``scheduler.task_prefixes``."""
        tp = self.prefixes.get(name)
        if tp is None:
            from distributed.scheduler import TaskPrefix

            listed = self.scheduler.task_prefixes.get(name)
            tp = self.prefixes[name] = TaskPrefix(name if listed is None else f"{name} (yr)")
        prefixes = self.scheduler.task_prefixes
        if prefixes.get(tp.name) is not tp:  # new, or Dask cleared its tables (restart)
            prefixes[tp.name] = tp
        return tp

    # -- events ----------------------------------------------------------------------------

    def add(self, worker: str, records: Iterable[Sequence[Any]], running: Mapping[str, int],
            queued: Mapping[str, int], now: float | None = None,
            tasks: Sequence[Sequence[Any]] = ()) -> None:
        """One worker's batch: records of ended calls, its running/queued counts now, and
        the tasks it has now (kept for Ray's ``list_tasks``, ``scheduler/state_view.py``)."""
        if tasks:
            self.tasks[worker] = tasks
        else:
            self.tasks.pop(worker, None)
        added = 0  # records, for the plugin's index (its readers count from it)
        now = time.time() if now is None else now
        plugin = self.task_stream()
        append = plugin.buffer.append
        per_name: dict[str, list] = {}  # name -> [done, erred, seconds]: one prefix update
        for name, call_id, start, stop, thread, ok in records:
            append((name, call_id, start, stop, thread, ok, worker))
            agg = per_name.get(name)
            if agg is None:
                agg = per_name[name] = [0, 0, 0.0]
            agg[0 if ok else 1] += 1
            agg[2] += stop - start
        for name, (done, erred, seconds) in per_name.items():
            tp = self.prefix(name)
            tp.states["memory"] += done
            tp.states["erred"] += erred
            tp.add_duration("compute", 0.0, seconds)  # adds to "Compute time per key"
            self.active_at[name] = now
            added += done + erred
        plugin.index += added
        self.records += added
        before = self.counts.get(worker, ({}, {}))
        self.counts[worker] = (dict(running), dict(queued))
        for state, old, new in (("processing", before[0], running), ("queued", before[1],
                                                                          queued)):
            for name in set(old) | set(new):
                delta = new.get(name, 0) - old.get(name, 0)
                if delta:
                    self.prefix(name).states[state] += delta
                    self.active_at[name] = now

    def worker_gone(self, worker: str) -> None:
        """A worker left: what it ran and queued no longer counts."""
        self.add(worker, (), {}, {})
        self.counts.pop(worker, None)
        self.tasks.pop(worker, None)

    def tick(self, lifecycle: Any, now: float | None = None) -> None:
        """Periodic: instance lifetimes per class, and fading of idle names' done counts.

        ``lifecycle``: the instance lifecycle (records with ``state`` and ``spec``; ``ended``
        tombstones with ``class`` and ``ended_at``).
        """
        now = time.time() if now is None else now
        from yrdask import protocol as P

        live: dict[str, Counter] = {}
        for rec in lifecycle.instances.values():
            cls = rec.spec.get("cls_name") or ""
            state = "queued" if rec.state == P.PENDING else (
                "processing" if rec.state in (P.ALIVE, P.RESTARTING) else None)
            if cls and state:
                live.setdefault(cls, Counter())[state] += 1
        ended: Counter = Counter()
        for tomb in lifecycle.ended:
            if tomb.get("class") and now - (tomb.get("ended_at") or now) < FADE_S:
                ended[tomb["class"]] += 1
        for cls in set(live) | set(ended) | self.classes:
            counts = live.get(cls, Counter())
            tp = self.prefix(cls)
            states = tp.states
            total = counts["queued"] + counts["processing"] + ended[cls]
            if total or cls in self.classes:
                states["queued"], states["processing"] = counts["queued"], counts["processing"]
                states["memory"] = ended[cls]
            self.classes.add(cls)
        for name, at in list(self.active_at.items()):
            if name in self.classes or now - at < FADE_S:
                continue
            states = self.prefix(name).states
            if not any(states[s] for s in LIVE):
                states["forgotten"] += states["memory"] + states["erred"]
                states["memory"] = states["erred"] = 0
                del self.active_at[name]



class StreamBuffer(deque):
    """Dask's Task Stream buffer, holding yr's records as flat tuples.

    A yr worker may end thousands of calls a second; as dicts in Dask's format (three
    containers each) a full buffer (``distributed.scheduler.dashboard.tasks.
    task-stream-length`` entries) would keep the garbage collector busy in the scheduler's
    process.  A tuple of plain values is not tracked by it, so yr's records stay tuples and
    become Dask's dicts only when read (``TaskStreamPlugin.collect``/``rectangles`` and the
    dashboard read by index; Dask's own entries are dicts and pass through).
    """

    def __getitem__(self, index: Any) -> Any:
        item = deque.__getitem__(self, index)
        return as_dask(item) if type(item) is tuple else item

    def __iter__(self) -> Any:
        for item in deque.__iter__(self):
            yield as_dask(item) if type(item) is tuple else item


def as_dask(rec: tuple) -> dict[str, Any]:
    """A yr record ``(name, id, start, stop, thread, ok, worker)`` in the Task Stream's format."""
    name, call_id, start, stop, thread, ok, worker = rec
    return {"key": f"{name}-{call_id}", "worker": worker, "thread": thread,
            "status": "OK" if ok else "error",
            "startstops": [{"action": "compute", "start": start, "stop": stop}]}
