"""What the scheduler knows of the cluster's work, read for Ray's state API and timeline.

:class:`yrdask.protocol.StateRecords` asks for one kind of record; the answer is built here
from what the extension keeps anyway, in yr's own terms (the Ray surface,
``yrdask/ray/util/state``, gives them Ray's names and filters them):

* ``"tasks"``: the yr records in Dask's Task Stream buffer (``scheduler/panels.py``), one
  per task or method call that *ended*, oldest first, at most ``limit`` of the newest; how
  many records the buffer ever took (``total``: older ones fell out of it); what each
  worker reported running and queued (counts by name); and the tasks (not method calls)
  each worker has now, running or queued, by id (``now``, each with its job);
* ``"instances"``: every instance the lifecycle holds, and the tombstones of the ended ones
  it keeps (``yrdask.scheduling.ended-instances-kept``);
* ``"groups"``: the live resource groups;
* ``"nodes"`` and ``"workers"``: the ledger's nodes and the worker processes.

Every answer carries ``processes`` (each worker process's node, host and pid) and ``jobs``
(each connected driver's owner address and job id).  Reading changes nothing.
"""

from __future__ import annotations

from typing import Any

KINDS = ("tasks", "instances", "groups", "nodes", "workers")


def state_records(ext: Any, kind: str, limit: int) -> dict[str, Any]:
    """The records of ``kind`` (one of :data:`KINDS`), see the module docstring."""
    if kind not in KINDS:
        raise ValueError(f"unknown state record kind {kind!r}; one of {', '.join(KINDS)}")
    out: dict[str, Any] = {"processes": processes(ext),
                           "jobs": {j.owner: j.job_id for j in ext.jobs.values()}}
    if kind == "tasks":
        out.update(task_rows(ext, limit))
    elif kind == "instances":
        life = ext.instances.lifecycle
        live = life.snapshot()
        for row in live:
            row["job"] = life.job_of(row["owner"])
            rec = life.instances.get(row["instance_id"])
            row["namespace"] = row["namespace"] or (rec.spec.get("namespace") or ""
                                                    if rec is not None else "")
        ended = [dict(row, state="DEAD") for row in life.ended_rows()]
        out["rows"] = live + ended
    elif kind == "groups":
        out["rows"] = [dict(g, detached=ext.rgroups.machine.groups[g["name"]].detached)
                       for g in ext.rgroups.machine.snapshot()]
    elif kind == "nodes":
        host = ext.scheduler.address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
        out["rows"] = [dict(node, node_id=node_id, head=node.get("host") == host)
                       for node_id, node in sorted(ext.ledger.snapshot().items())]
    return out


def processes(ext: Any) -> dict[str, dict[str, Any]]:
    """``{address: {"node", "host", "pid"}}`` of every yr worker process in the ledger."""
    out = {}
    for node_id, node in ext.ledger.workers.items():
        for address in node.processes:
            ws = ext.scheduler.workers.get(address)
            out[address] = {"node": node_id, "host": node.host or node_id,
                            "pid": getattr(ws, "pid", None)}
    return out


def task_rows(ext: Any, limit: int) -> dict[str, Any]:
    """``rows``: ``[name, id, start, stop, thread, ok, worker, instance_id]`` per ended yr
    call in the Task Stream buffer (the newest ``limit``, oldest first); ``instance_id`` is
    the instance of an ``__init__`` record, or of a method call when only one instance of
    that class has been on that worker, else ``""``."""
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    plugin = ext.scheduler.plugins.get(TaskStreamPlugin.name)
    records = ([r for r in deque_items(plugin.buffer) if type(r) is tuple]
               if plugin is not None else [])
    kept = len(records)
    if limit >= 0:
        records = records[max(0, kept - limit):]
    hosted: dict[tuple[str, str], set[str]] = {}  # (worker, class) -> instances there
    life = ext.instances.lifecycle
    for row in life.snapshot() + life.ended_rows():
        if row.get("worker") and row.get("class"):
            hosted.setdefault((row["worker"], row["class"]), set()).add(row["instance_id"])
    rows = []
    for name, call_id, start, stop, thread, ok, worker in records:
        instance = ""
        cls, dot, method = name.rpartition(".")
        if dot and method == "__init__" and call_id.startswith("i_"):
            instance = "i-" + call_id[2:]
        elif dot:
            there = hosted.get((worker, cls))
            if there is not None and len(there) == 1:
                instance = next(iter(there))
        rows.append([name, call_id, start, stop, thread, ok, worker, instance])
    counts = ext.panels.counts
    now = [[name, task_id, bool(started), life.job_of(owner), worker]
           for worker, tasks in ext.panels.tasks.items()
           for name, task_id, started, owner in tasks]
    return {"rows": rows, "now": now, "kept": kept, "total": max(ext.panels.records, kept),
            "classes": sorted({c for _w, c in hosted}),
            "running": {w: dict(c[0]) for w, c in counts.items()},
            "queued": {w: dict(c[1]) for w, c in counts.items()}}


def deque_items(buffer: Any) -> list:
    """The raw items of Dask's Task Stream buffer (yr's stay tuples: ``panels.StreamBuffer``)."""
    from collections import deque

    return list(deque.__iter__(buffer))
