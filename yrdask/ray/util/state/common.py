"""Ray's state records (``ActorState``, ``TaskState``, ...) and how Ray filters them.

The record classes have Ray 2.x's field names, in Ray's order; a field is *filterable*
(usable in ``filters``) and/or *detail* (filled only with ``detail=True``; ``None``
otherwise) as in Ray.  Records read like Ray's: ``rec.state``, ``rec["state"]``,
``rec.get("state")``, ``rec.asdict()``.  The functions here are pure: they check the
arguments of a list call, filter, sort and limit rows, and summarise them, with Ray's rules
and Ray's errors (docs/migrating-from-ray.md, "ray.util.state").
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Optional

from yrdask.ray.util.state.exception import RayStateApiException

DEFAULT_LIMIT = 100
DEFAULT_RPC_TIMEOUT = 30
MAX_LIMIT = 10_000  # Ray's RAY_MAX_LIMIT_FROM_API_SERVER default
PREDICATES = ("=", "!=")


def column(*, filterable: bool, detail: bool = False) -> Any:
    """A record field: ``filterable`` in ``filters``, ``detail`` only with ``detail=True``."""
    return dataclasses.field(default=None, metadata={"filterable": filterable,
                                                     "detail": detail})


class StateSchema:
    """Base of the record classes: Ray's dict-style access and column lists."""

    @classmethod
    def list_columns(cls, detail: bool = True) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)
                if detail or not f.metadata.get("detail")]

    @classmethod
    def filterable_columns(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.metadata.get("filterable")}

    @classmethod
    def from_row(cls, row: dict[str, Any], detail: bool) -> "StateSchema":
        """The record of ``row`` (a dict with every column), detail columns kept only with
        ``detail``."""
        keep = cls.list_columns(detail)
        return cls(**{name: row.get(name) for name in keep})

    def asdict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@dataclasses.dataclass
class ActorState(StateSchema):
    """An actor: ``state`` is PENDING_CREATION, ALIVE, RESTARTING or DEAD."""

    actor_id: Optional[str] = column(filterable=True)
    class_name: Optional[str] = column(filterable=True)
    state: Optional[str] = column(filterable=True)
    job_id: Optional[str] = column(filterable=True)
    name: Optional[str] = column(filterable=True)
    node_id: Optional[str] = column(filterable=True)
    pid: Optional[int] = column(filterable=True)
    ray_namespace: Optional[str] = column(filterable=True)
    serialized_runtime_env: Optional[str] = column(filterable=False, detail=True)
    required_resources: Optional[dict] = column(filterable=False, detail=True)
    death_cause: Optional[dict] = column(filterable=False, detail=True)
    is_detached: Optional[bool] = column(filterable=False, detail=True)
    placement_group_id: Optional[str] = column(filterable=True, detail=True)
    repr_name: Optional[str] = column(filterable=True, detail=True)
    num_restarts: Optional[int] = column(filterable=False, detail=True)
    num_restarts_due_to_lineage_reconstruction: Optional[int] = column(filterable=False,
                                                                        detail=True)
    num_restarts_due_to_node_preemption: Optional[int] = column(filterable=False,
                                                                 detail=True)
    call_site: Optional[str] = column(filterable=False, detail=True)
    label_selector: Optional[dict] = column(filterable=False, detail=True)
    fallback_strategy: Optional[dict] = column(filterable=False, detail=True)


@dataclasses.dataclass
class TaskState(StateSchema):
    """A task, actor task or actor creation: ``state`` FINISHED or FAILED (ended), RUNNING
    or SUBMITTED_TO_WORKER (a task a worker holds now)."""

    task_id: Optional[str] = column(filterable=True)
    attempt_number: Optional[int] = column(filterable=True)
    name: Optional[str] = column(filterable=True)
    state: Optional[str] = column(filterable=True)
    job_id: Optional[str] = column(filterable=True)
    actor_id: Optional[str] = column(filterable=True)
    type: Optional[str] = column(filterable=True)  # noqa: A003 - Ray's name
    func_or_class_name: Optional[str] = column(filterable=True)
    parent_task_id: Optional[str] = column(filterable=True)
    node_id: Optional[str] = column(filterable=True)
    worker_id: Optional[str] = column(filterable=True)
    worker_pid: Optional[int] = column(filterable=True)
    error_type: Optional[str] = column(filterable=True)
    language: Optional[str] = column(filterable=True, detail=True)
    required_resources: Optional[dict] = column(filterable=False, detail=True)
    runtime_env_info: Optional[dict] = column(filterable=False, detail=True)
    placement_group_id: Optional[str] = column(filterable=True, detail=True)
    events: Optional[list] = column(filterable=False, detail=True)
    profiling_data: Optional[dict] = column(filterable=False, detail=True)
    creation_time_ms: Optional[int] = column(filterable=False, detail=True)
    start_time_ms: Optional[int] = column(filterable=False, detail=True)
    end_time_ms: Optional[int] = column(filterable=False, detail=True)
    task_log_info: Optional[dict] = column(filterable=False, detail=True)
    error_message: Optional[str] = column(filterable=False, detail=True)
    is_debugger_paused: Optional[bool] = column(filterable=True, detail=True)
    call_site: Optional[str] = column(filterable=False, detail=True)
    label_selector: Optional[dict] = column(filterable=False, detail=True)
    fallback_strategy: Optional[dict] = column(filterable=False, detail=True)


@dataclasses.dataclass
class ObjectState(StateSchema):
    """An object this process holds a reference to."""

    object_id: Optional[str] = column(filterable=True)
    object_size: Optional[int] = column(filterable=True)
    task_status: Optional[str] = column(filterable=True)
    attempt_number: Optional[int] = column(filterable=True)
    reference_type: Optional[str] = column(filterable=True)
    call_site: Optional[str] = column(filterable=True)
    type: Optional[str] = column(filterable=True)  # noqa: A003 - Ray's name
    pid: Optional[int] = column(filterable=True)
    ip: Optional[str] = column(filterable=True)


@dataclasses.dataclass
class PlacementGroupState(StateSchema):
    """A placement group: ``state`` PENDING or CREATED."""

    placement_group_id: Optional[str] = column(filterable=True)
    name: Optional[str] = column(filterable=True)
    creator_job_id: Optional[str] = column(filterable=True)
    state: Optional[str] = column(filterable=True)
    bundles: Optional[list] = column(filterable=False, detail=True)
    is_detached: Optional[bool] = column(filterable=True, detail=True)
    stats: Optional[dict] = column(filterable=False, detail=True)
    topology_strategy: Optional[dict] = column(filterable=False, detail=True)
    topology_assignments: Optional[dict] = column(filterable=False, detail=True)


@dataclasses.dataclass
class NodeState(StateSchema):
    """A node (a host, docs/nodes.md)."""

    node_id: Optional[str] = column(filterable=True)
    node_ip: Optional[str] = column(filterable=True)
    is_head_node: Optional[bool] = column(filterable=True)
    state: Optional[str] = column(filterable=True)
    state_message: Optional[str] = column(filterable=False)
    node_name: Optional[str] = column(filterable=True)
    resources_total: Optional[dict] = column(filterable=False)
    labels: Optional[dict] = column(filterable=False)
    start_time_ms: Optional[int] = column(filterable=False, detail=True)
    end_time_ms: Optional[int] = column(filterable=False, detail=True)


@dataclasses.dataclass
class WorkerState(StateSchema):
    """A worker process, or a driver."""

    worker_id: Optional[str] = column(filterable=True)
    is_alive: Optional[bool] = column(filterable=True)
    worker_type: Optional[str] = column(filterable=True)
    exit_type: Optional[str] = column(filterable=True)
    node_id: Optional[str] = column(filterable=True)
    ip: Optional[str] = column(filterable=True)
    pid: Optional[int] = column(filterable=True)
    exit_detail: Optional[str] = column(filterable=False, detail=True)
    worker_launch_time_ms: Optional[int] = column(filterable=False, detail=True)
    worker_launched_time_ms: Optional[int] = column(filterable=False, detail=True)
    start_time_ms: Optional[int] = column(filterable=False, detail=True)
    end_time_ms: Optional[int] = column(filterable=False, detail=True)
    debugger_port: Optional[int] = column(filterable=True, detail=True)
    num_paused_threads: Optional[int] = column(filterable=True, detail=True)


# -- the arguments of a list call -----------------------------------------------------------

def check_list_args(filters: Any, limit: Any, detail: Any, timeout: Any) -> list[tuple]:
    """Ray's checks of a list call's arguments (its ``ListApiOptions`` and its API server),
    before anything is asked: the filters as ``(key, predicate, value)`` tuples."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise ValueError(f"limit must be an int, got {limit!r}")
    if not isinstance(detail, bool):
        raise ValueError(f"detail must be a bool, got {detail!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if filters is None:
        filters = []
    if not isinstance(filters, (list, tuple)):
        raise ValueError(f"filters must be a list of (key, predicate, value) tuples, got "
                         f"{filters!r}")
    out = []
    for f in filters:
        if not isinstance(f, (list, tuple)) or len(f) != 3:
            raise ValueError(f"The given filter has incorrect input type, {f}. "
                             "Provide (key, predicate, value) tuples.")
        key, predicate, value = f
        if predicate not in PREDICATES:
            raise ValueError(f"Unsupported filter predicate {predicate} is given. "
                             "Available predicates: =, !=.")
        out.append((key, predicate, value))
    if limit > MAX_LIMIT:
        raise RayStateApiException(
            f"Given limit {limit} exceeds the supported limit {MAX_LIMIT}. Use a lower "
            "limit, or set the `RAY_MAX_LIMIT_FROM_API_SERVER` environment variable to a "
            "larger value.")
    if limit < 0:
        raise RayStateApiException(f"limit must be 0 or more, got {limit}")
    return out


def conflicting(filters: list[tuple]) -> bool:
    """True, with Ray's warning, when two ``=`` filters on one key want different values:
    nothing can match (Ray then answers ``[]`` without asking)."""
    equal: dict[str, Any] = {}
    for key, predicate, value in filters:
        if predicate != "=":
            continue
        if key in equal and equal[key] != value:
            warnings.warn(f"There are multiple '=' filters with the same key '{key}' but "
                          f"different values'{equal[key]}' & '{value}'. Empty result set "
                          "will be returned", UserWarning, stacklevel=3)
            return True
        equal.setdefault(key, value)
    return False


# -- filtering, as Ray's API server does ----------------------------------------------------

def _column_types(schema: type[StateSchema]) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(schema)}


def _convert(value: Any, to: type) -> Any:
    """Ray's string-to-type conversion of a filter value (``"1"`` -> 1, ``"true"`` -> True)."""
    if value is None or type(value) is to:
        return value
    if to is bool:
        if value in ("False", "false", "0"):
            return False
        if value in ("True", "true", "1"):
            return True
    else:
        try:
            return to(value)
        except (TypeError, ValueError):
            pass
    raise RayStateApiException(f"Failed to convert a value {value} of type {type(value)} "
                               f"to {to}")


def prepare_filters(filters: list[tuple], schema: type[StateSchema]) -> list[tuple]:
    """Lower-case the keys, check they name filterable columns, and turn string values of
    int and bool columns into ints and bools (Ray's errors otherwise)."""
    filterable = schema.filterable_columns()
    types = _column_types(schema)
    out = []
    for key, predicate, value in filters:
        col = str(key).lower()
        if col not in filterable:
            raise RayStateApiException(
                f"The given filter column {col} is not supported. Enter filters with "
                f"--filter key=value or --filter key!=value Supported filter columns: "
                f"{filterable}")
        kind = types[col]
        if isinstance(value, str) and kind in ("Optional[int]", "Optional[bool]") \
                and predicate == "=":
            value = _convert(value, int if kind == "Optional[int]" else bool)
        out.append((col, predicate, value))
    return out


def matches(row: dict[str, Any], filters: list[tuple]) -> bool:
    """Ray's match: strings compare case-insensitively (``=`` and ``!=``); all filters must
    hold."""
    for col, predicate, value in filters:
        have = row.get(col)
        if isinstance(value, str) and isinstance(have, str):
            same = have.lower() == value.lower()
        else:
            same = have == value
        if same != (predicate == "="):
            return False
    return True


def select(rows: Iterable[dict[str, Any]], schema: type[StateSchema], filters: list[tuple],
           limit: int, detail: bool, key: str) -> list[StateSchema]:
    """Filter ``rows``, sort them by ``key`` (as Ray sorts), keep ``limit``, make records."""
    prepared = prepare_filters(filters, schema)
    kept = [r for r in rows if matches(r, prepared)]
    kept.sort(key=lambda r: r.get(key) or "")
    return [schema.from_row(r, detail) for r in kept[:limit]]


# -- summaries (Ray's layouts) ---------------------------------------------------------------

def summarize_task_rows(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Ray's ``TaskSummaries`` by function name: ``{"summary": {name: {"func_or_class_name",
    "type", "state_counts"}}, "total_tasks", "total_actor_tasks", "total_actor_scheduled",
    "summary_by": "func_name"}``; rows may carry a ``count`` (several tasks in one row)."""
    summary: dict[str, dict[str, Any]] = {}
    totals = {"NORMAL_TASK": 0, "ACTOR_TASK": 0, "ACTOR_CREATION_TASK": 0}
    for row in rows:
        key = row.get("name") or row.get("func_or_class_name")
        entry = summary.setdefault(key, {"func_or_class_name": key, "type": row["type"],
                                         "state_counts": {}})
        n = row.get("count", 1)
        counts = entry["state_counts"]
        counts[row["state"]] = counts.get(row["state"], 0) + n
        if row["type"] in totals:
            totals[row["type"]] += n
    return {"summary": summary, "total_tasks": totals["NORMAL_TASK"],
            "total_actor_tasks": totals["ACTOR_TASK"],
            "total_actor_scheduled": totals["ACTOR_CREATION_TASK"], "summary_by": "func_name"}


def summarize_actor_rows(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Ray's ``ActorSummaries``: ``{"summary": {class: {"class_name", "state_counts"}},
    "total_actors", "summary_by": "class"}``."""
    summary: dict[str, dict[str, Any]] = {}
    total = 0
    for row in rows:
        entry = summary.setdefault(row["class_name"], {"class_name": row["class_name"],
                                                       "state_counts": {}})
        counts = entry["state_counts"]
        counts[row["state"]] = counts.get(row["state"], 0) + 1
        total += 1
    return {"summary": summary, "total_actors": total, "summary_by": "class"}


def summarize_object_rows(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Ray's ``ObjectSummaries`` by call site (``"disabled"``: call sites are not kept)."""
    summary: dict[str, dict[str, Any]] = {}
    workers: dict[str, set] = {}
    nodes: dict[str, set] = {}
    total_objects, total_mb = 0, 0.0
    for row in rows:
        key = row["call_site"]
        entry = summary.setdefault(key, {
            "total_objects": 0, "total_size_mb": 0.0, "total_num_workers": 0,
            "total_num_nodes": 0, "task_state_counts": {}, "task_attempt_number_counts": {},
            "ref_type_counts": {}})
        mb = max(row["object_size"] or 0, 0) / 2 ** 20
        entry["total_objects"] += 1
        entry["total_size_mb"] += mb
        for field, value in (("task_state_counts", row["task_status"]),
                             ("task_attempt_number_counts", str(row["attempt_number"])),
                             ("ref_type_counts", row["reference_type"])):
            entry[field][value] = entry[field].get(value, 0) + 1
        workers.setdefault(key, set()).add(row["pid"])
        nodes.setdefault(key, set()).add(row["ip"])
        entry["total_num_workers"] = len(workers[key])
        entry["total_num_nodes"] = len(nodes[key])
        total_objects += 1
        total_mb += mb
    return {"summary": summary, "total_objects": total_objects, "total_size_mb": total_mb,
            "callsite_enabled": False, "summary_by": "callsite"}
