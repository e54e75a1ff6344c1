"""``ray.util.state``'s list, get and summary calls, from the scheduler's records.

One scheduler rpc per call (:class:`yrdask.protocol.StateRecords`, answered by
``yrdask/scheduler/state_view.py``) brings the records in yr's terms; here they get Ray's
field names (``common.py``) and are filtered, sorted and limited as Ray's API server does.
Objects are the exception: they are the ones this process holds, read from its own object
table (no process keeps a cluster-wide one).  What is kept and for how long:
docs/migrating-from-ray.md, "ray.util.state".
"""

from __future__ import annotations

import os
from typing import Any, Optional

from yrdask import protocol as P
from yrdask.ray._options import NODE_ID_LABEL
from yrdask.ray.util.state.common import (DEFAULT_LIMIT, DEFAULT_RPC_TIMEOUT, MAX_LIMIT,
                                          ActorState, NodeState, ObjectState,
                                          PlacementGroupState, StateSchema, TaskState,
                                          WorkerState, check_list_args, conflicting, select,
                                          summarize_actor_rows, summarize_object_rows,
                                          summarize_task_rows)
from yrdask.ray.util.state.exception import RayStateApiException

ACTOR_STATES = {P.PENDING: "PENDING_CREATION", P.ALIVE: "ALIVE",
                P.RESTARTING: "RESTARTING", P.DEAD: "DEAD"}


# -- asking the scheduler -------------------------------------------------------------------

def _runtime(address: Optional[str]) -> Any:
    """The runtime of this process's session (the state API asks the cluster it is on)."""
    from yrdask.runtime import context

    rt = context.installed_runtime()
    if rt is None:
        raise ConnectionError("Ray's state API needs a running session: call ray.init() "
                              "first (or run it inside a task or actor)")
    if address not in (None, "auto"):
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        here = _scheduler_address(rt)
        if address != here:
            raise ValueError(f"address={address!r} is not the cluster this session is on "
                             f"({here}); the state API asks the session's own cluster: "
                             "leave address out")
    return rt


def _scheduler_address(rt: Any) -> str:
    conn = rt.connector
    address = getattr(conn, "scheduler_address", None)
    return address if address is not None else conn.worker.scheduler.address


def records(kind: str, address: Optional[str], timeout: float, limit: int = -1) -> dict:
    """The scheduler's :class:`yrdask.protocol.StateRecords` answer for ``kind``."""
    rt = _runtime(address)
    return rt.run_sync(rt.connector.scheduler_rpc(P.STATE_RECORDS, kind=kind, limit=limit),
                       timeout)


def _listing(schema: type[StateSchema], key: str, rows_of: Any, address: Optional[str],
             filters: Any, limit: Any, timeout: Any, detail: Any) -> list:
    """Ray's list call: check the arguments, get the rows, filter, sort, limit."""
    filters = check_list_args(filters, limit, detail, timeout)
    if conflicting(filters):
        return []
    return select(rows_of(address, timeout), schema, filters, limit, detail, key)


# -- rows in Ray's terms ---------------------------------------------------------------------

def _ray_units(shape: Optional[dict]) -> dict:
    """A yr shape (CPU millicores, Memory MB) in Ray's units, without the zero amounts."""
    from yrdask.ray.worker import _ray_units as ray_units

    return {k: v for k, v in ray_units(shape or {}).items() if v}


def actor_rows(address: Optional[str], timeout: float) -> list[dict]:
    reply = records("instances", address, timeout)
    procs = reply["processes"]
    out = []
    for row in reply["rows"]:
        proc = procs.get(row.get("worker") or "", {})
        state = ACTOR_STATES.get(row["state"], row["state"])
        iid = row["instance_id"]
        death = None
        if state == "DEAD":
            death = {"actor_died_error_context": {
                "error_message": f"The actor is dead because {row.get('reason') or 'it ended'}.",
                "actor_id": iid, "class_name": row["class"], "name": row["name"] or "",
                "ray_namespace": row["namespace"] or "", "pid": proc.get("pid") or 0,
                "node_ip_address": proc.get("host"), "reason": row.get("reason") or ""}}
        out.append({
            "actor_id": iid, "class_name": row["class"], "state": state,
            "job_id": row.get("job"), "name": row["name"] or "",
            "node_id": proc.get("node"), "pid": proc.get("pid") or 0,
            "ray_namespace": row["namespace"] or "", "serialized_runtime_env": "{}",
            "required_resources": _ray_units(row.get("resources")), "death_cause": death,
            "is_detached": bool(row.get("detached")), "placement_group_id": None,
            "repr_name": "", "num_restarts": row.get("restarts", 0),
            "num_restarts_due_to_lineage_reconstruction": 0,
            "num_restarts_due_to_node_preemption": 0, "call_site": None,
            "label_selector": {}, "fallback_strategy": None})
    return out


def task_type(name: str, instance: str, classes: Any) -> str:
    """Ray's task type of a record: an instance's ``__init__``, a method of a class the
    scheduler knows (``Class.method``), else a task."""
    cls, dot, method = name.rpartition(".")
    if dot and method == "__init__" and instance:
        return "ACTOR_CREATION_TASK"
    if dot and (instance or cls in classes):
        return "ACTOR_TASK"
    return "NORMAL_TASK"


def check_complete(reply: dict) -> None:
    """Ray's error when not every ended call the cluster ran came back (``raise_on_missing_
    output``): older ones fell out of the scheduler's history, or more than :data:`MAX_LIMIT`
    are kept (the scheduler sends the newest ones, as Ray's data sources truncate)."""
    total, got = reply["total"], len(reply["rows"])
    if total > got:
        raise RayStateApiException(
            f"Failed to retrieve all {total} tasks from the cluster because they are not "
            f"reachable due to data truncation: only the newest {got} came back (the "
            "scheduler keeps distributed.scheduler.dashboard.tasks.task-stream-length ended "
            f"calls and sends at most {MAX_LIMIT}). To avoid raising an exception and allow "
            "having missing output, set `raise_on_missing_output=False`.")


def short_name(name: str) -> str:
    """Ray's name of a function or method defined inside a function: ``sq`` and ``C.m``
    for the records' ``test.<locals>.sq`` and ``test.<locals>.C.m``."""
    return name.rpartition("<locals>.")[2]


def _task_reply(address: Optional[str], timeout: float) -> tuple[dict, list[dict]]:
    """The scheduler's task reply and its rows in Ray's terms (oldest first)."""
    reply = records("tasks", address, timeout, MAX_LIMIT)
    procs, classes = reply["processes"], set(reply["classes"])
    out = []
    for name, call_id, start, stop, _thread, ok, worker, instance in reply["rows"]:
        proc = procs.get(worker, {})
        state = "FINISHED" if ok else "FAILED"
        start_ms, end_ms = int(start * 1000), int(stop * 1000)
        out.append({
            "task_id": call_id, "attempt_number": 0, "name": short_name(name),
            "state": state, "job_id": None, "actor_id": instance or None,
            "type": task_type(name, instance, classes), "func_or_class_name": short_name(name),
            "parent_task_id": None, "node_id": proc.get("node"), "worker_id": worker,
            "worker_pid": proc.get("pid"),
            "error_type": None if ok else "TASK_EXECUTION_EXCEPTION", "language": "PYTHON",
            "events": [{"state": "RUNNING", "created_ms": start_ms},
                       {"state": state, "created_ms": end_ms}],
            "start_time_ms": start_ms, "end_time_ms": end_ms})
    for name, task_id, started, job, worker in reply["now"]:
        proc = procs.get(worker, {})
        state = "RUNNING" if started else "SUBMITTED_TO_WORKER"
        out.append({
            "task_id": task_id, "attempt_number": 0, "name": short_name(name),
            "state": state, "job_id": job, "actor_id": None, "type": "NORMAL_TASK",
            "func_or_class_name": short_name(name), "parent_task_id": None,
            "node_id": proc.get("node"), "worker_id": worker, "worker_pid": proc.get("pid"),
            "error_type": None, "language": "PYTHON", "events": [{"state": state}]})
    return reply, out


def object_rows(address: Optional[str], timeout: float) -> list[dict]:
    """The objects this process holds a reference to, from its own object table."""
    from distributed.comm import get_address_host

    rt = _runtime(address)
    ip = get_address_host(rt.address) if rt.address else None
    kind = "WORKER" if rt.agent is not None else "DRIVER"
    out = []
    for oid, entry in list(rt.objects.entries.items()):
        payload = entry.payload
        size = len(payload) if isinstance(payload, (bytes, bytearray)) else -1
        if entry.owner is not None:
            status = "NIL"  # borrowed: the owner knows its task
        else:
            status = {P.VALUE: "FINISHED", P.LOCATION: "FINISHED",
                      P.ERROR: "FAILED"}.get(entry.state, "SUBMITTED_TO_WORKER")
        out.append({"object_id": oid, "object_size": size, "task_status": status,
                    "attempt_number": 1,
                    "reference_type": "LOCAL_REFERENCE" if entry.refs else "PINNED_IN_MEMORY",
                    "call_site": "disabled", "type": kind, "pid": os.getpid(), "ip": ip})
    return out


def group_rows(address: Optional[str], timeout: float) -> list[dict]:
    reply = records("groups", address, timeout)
    procs, jobs = reply["processes"], reply["jobs"]
    nodes = {p["node"] for p in procs.values()}
    out = []
    for g in reply["rows"]:
        name = g["name"]
        out.append({
            "placement_group_id": name, "name": "" if name.startswith("rgroup-") else name,
            "creator_job_id": jobs.get(g["owner"]), "state": g["state"],
            "bundles": [{"bundle_id": {"placement_group_id": name, "bundle_index": i},
                         "unit_resources": _ray_units(b["shape"]),
                         "node_id": b["worker"] if b["worker"] in nodes else None}
                        for i, b in enumerate(g["bundles"])],
            "is_detached": bool(g.get("detached")), "stats": None,
            "topology_strategy": {}, "topology_assignments": {}})
    return out


def node_rows(address: Optional[str], timeout: float) -> list[dict]:
    reply = records("nodes", address, timeout)
    return [{"node_id": n["node_id"], "node_ip": n.get("host") or n["node_id"],
             "is_head_node": bool(n.get("head")), "state": "ALIVE", "state_message": None,
             "node_name": n.get("host") or n["node_id"],
             "resources_total": _ray_units(n["capacity"]),
             "labels": {**(n.get("labels") or {}), NODE_ID_LABEL: n["node_id"]},
             "start_time_ms": None, "end_time_ms": None} for n in reply["rows"]]


def worker_rows(address: Optional[str], timeout: float) -> list[dict]:
    reply = records("workers", address, timeout)
    out = [{"worker_id": a, "is_alive": True, "worker_type": "WORKER", "exit_type": None,
            "node_id": p["node"], "ip": p["host"], "pid": p["pid"]}
           for a, p in reply["processes"].items()]
    from distributed.comm import get_address_host

    for owner, _job in reply["jobs"].items():
        out.append({"worker_id": owner, "is_alive": True, "worker_type": "DRIVER",
                    "exit_type": None, "node_id": None, "ip": get_address_host(owner),
                    "pid": None})
    return out


# -- Ray's calls ----------------------------------------------------------------------------

def list_actors(address: Optional[str] = None, filters: Optional[list] = None,
                limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT,
                detail: bool = False, raise_on_missing_output: bool = True) -> list[ActorState]:
    """Actors (every instance) the scheduler holds, and the ended ones it keeps."""
    return _listing(ActorState, "actor_id", actor_rows, address, filters, limit, timeout,
                    detail)


def list_tasks(address: Optional[str] = None, filters: Optional[list] = None,
               limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT,
               detail: bool = False, raise_on_missing_output: bool = True) -> list[TaskState]:
    """Tasks, actor tasks and actor creations that ended (FINISHED or FAILED), as long as
    the scheduler's Task Stream history keeps them, and the tasks workers run (RUNNING) or
    hold waiting for a thread (SUBMITTED_TO_WORKER) now."""
    checked = check_list_args(filters, limit, detail, timeout)
    if conflicting(checked):
        return []
    reply, rows = _task_reply(address, timeout)
    if raise_on_missing_output:
        check_complete(reply)
    return select(rows, TaskState, checked, limit, detail, "task_id")


def list_objects(address: Optional[str] = None, filters: Optional[list] = None,
                 limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT,
                 detail: bool = False, raise_on_missing_output: bool = True) -> list[ObjectState]:
    """Objects the calling process holds a reference to (owned or borrowed)."""
    return _listing(ObjectState, "object_id", object_rows, address, filters, limit, timeout,
                    detail)


def list_placement_groups(address: Optional[str] = None, filters: Optional[list] = None,
                          limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT,
                          detail: bool = False, raise_on_missing_output: bool = True) -> list[PlacementGroupState]:
    """Live placement groups (every resource group)."""
    return _listing(PlacementGroupState, "placement_group_id", group_rows, address, filters,
                    limit, timeout, detail)


def list_nodes(address: Optional[str] = None, filters: Optional[list] = None,
               limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT,
               detail: bool = False, raise_on_missing_output: bool = True) -> list[NodeState]:
    """The nodes (hosts) the scheduler's ledger holds."""
    return _listing(NodeState, "node_id", node_rows, address, filters, limit, timeout,
                    detail)


def list_workers(address: Optional[str] = None, filters: Optional[list] = None,
                 limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT,
                 detail: bool = False, raise_on_missing_output: bool = True) -> list[WorkerState]:
    """The worker processes, and the connected drivers."""
    return _listing(WorkerState, "worker_id", worker_rows, address, filters, limit, timeout,
                    detail)


def get_actor(id: str, address: Optional[str] = None,  # noqa: A002 - Ray's name
              timeout: int = DEFAULT_RPC_TIMEOUT) -> Optional[ActorState]:
    """The actor with this id (``handle._actor_id.hex()``), with detail; None if unknown."""
    if not isinstance(id, str):
        raise TypeError(f"id must be a str, got {type(id).__name__}")
    found = list_actors(address, [("actor_id", "=", id)], MAX_LIMIT, timeout, True)
    return found[0] if found else None


def summarize_tasks(address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                    raise_on_missing_output: bool = True) -> dict:
    """Ray's task summary by name: the ended tasks the scheduler keeps, and what workers
    run (RUNNING) or hold waiting for a thread (SUBMITTED_TO_WORKER) now."""
    check_list_args(None, MAX_LIMIT, False, timeout)
    reply, rows = _task_reply(address, timeout)
    if raise_on_missing_output:
        check_complete(reply)
    classes = set(reply["classes"])
    listed: dict[tuple, int] = {}  # (worker, name, started) -> tasks listed by id
    for name, _task_id, started, _job, worker in reply["now"]:
        listed[worker, name, started] = listed.get((worker, name, started), 0) + 1
    for state, started, per_worker in (("RUNNING", True, reply["running"]),
                                       ("SUBMITTED_TO_WORKER", False, reply["queued"])):
        for worker, counts in per_worker.items():
            for name, n in counts.items():  # method calls, and queued tasks not listed
                n -= listed.get((worker, name, started), 0)
                if n > 0:
                    rows.append({"name": short_name(name), "state": state, "count": n,
                                 "type": task_type(name, "", classes)})
    return {"cluster": summarize_task_rows(rows)}


def summarize_actors(address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                     raise_on_missing_output: bool = True) -> dict:
    """Ray's actor summary: counts by class and state."""
    check_list_args(None, MAX_LIMIT, False, timeout)
    return {"cluster": summarize_actor_rows(actor_rows(address, timeout))}


def summarize_objects(address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                      raise_on_missing_output: bool = True) -> dict:
    """Ray's object summary of this process's objects."""
    check_list_args(None, MAX_LIMIT, False, timeout)
    return {"cluster": summarize_object_rows(object_rows(address, timeout))}
