"""``ray.timeline()``: the tasks and actor calls that ended, as a Chrome trace.

Built from the records behind Dask's Task Stream (the scheduler's ``StateRecords`` of kind
``"tasks"``): one complete event (``"ph": "X"``) per task or method call, laid out as Ray
lays out its trace: ``pid`` the node, ``tid`` the worker (here a worker process's thread:
one yrdask worker process runs several tasks at once), ``ts``/``dur`` in microseconds.
Open the file in ``chrome://tracing`` or Perfetto.
"""

from __future__ import annotations

import json
from typing import Any, Optional


def timeline(filename: Optional[str] = None) -> Optional[list[dict[str, Any]]]:
    """The trace events of the newest 10 000 calls that ended, oldest first; with
    ``filename``, written there as JSON instead."""
    from yrdask.ray._session import is_initialized
    from yrdask.ray.util.state.api import records
    from yrdask.ray.util.state.common import DEFAULT_RPC_TIMEOUT, MAX_LIMIT

    if not is_initialized():
        raise RuntimeError("Ray has not been started yet. Timeline requires Ray to be "
                           "initialized first.")
    if filename is not None and not isinstance(filename, (str, bytes)) \
            and not hasattr(filename, "__fspath__"):
        raise TypeError(f"filename must be a path, got {type(filename).__name__}")
    reply = records("tasks", None, DEFAULT_RPC_TIMEOUT, MAX_LIMIT)  # the newest, as Ray
    events = trace_events(reply["rows"], reply["processes"])
    if filename is None:
        return events
    with open(filename, "w") as f:
        json.dump(events, f)
    return None


def trace_events(rows: list, processes: dict[str, dict]) -> list[dict[str, Any]]:
    """One Chrome trace event per record ``[name, id, start, stop, thread, ok, worker, _]``."""
    from yrdask.ray.util.state.api import short_name

    out = []
    for full, call_id, start, stop, thread, ok, worker, _instance in rows:
        name = short_name(full)
        node = processes.get(worker, {}).get("host") or worker
        out.append({"cat": f"task::{name}", "name": name, "pid": node,
                    "tid": f"worker:{worker} thread {thread}",
                    "ts": start * 1e6, "dur": (stop - start) * 1e6, "ph": "X",
                    "cname": "generic_work" if ok else "terrible",
                    "args": {"name": name, "task_id": call_id,
                             "state": "FINISHED" if ok else "FAILED"}})
    return out
