"""Ray's ``@ray.remote`` / ``.options()`` keywords checked and turned into ``yr.InvokeOptions``.

One table (:data:`_OPTIONS`) says which keywords exist for tasks, actors and actor methods;
:func:`to_invoke_options` maps the supported ones to yr's units (``num_cpus=1`` is 1000
millicores, ``memory`` bytes become MB, ``num_gpus`` the custom resource ``"GPU"``) and raises
:class:`~yrdask.ray.exceptions.UnsupportedOptionError` naming any Ray option yrdask cannot honour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from yrdask.affinity import Affinity, AffinityKind, AffinityType, LabelOperator, OperatorType
from yrdask.options import InvokeOptions
from yrdask.ray.exceptions import UnsupportedOptionError

TASK, ACTOR, METHOD = "task", "actor", "actor method"

#: Every Ray option, for which kinds it exists, and the Ray default a value must keep when
#: yrdask does not support the option (``_UNSET``: any value is supported).
_UNSET = object()
_OPTIONS: dict[str, tuple[frozenset, Any]] = {
    "num_cpus": (frozenset({TASK, ACTOR}), _UNSET),
    "num_gpus": (frozenset({TASK, ACTOR}), _UNSET),
    "memory": (frozenset({TASK, ACTOR}), _UNSET),
    "resources": (frozenset({TASK, ACTOR}), _UNSET),
    "runtime_env": (frozenset({TASK, ACTOR}), _UNSET),
    "scheduling_strategy": (frozenset({TASK, ACTOR}), _UNSET),
    "name": (frozenset({TASK, ACTOR, METHOD}), _UNSET),
    "num_returns": (frozenset({TASK, METHOD}), _UNSET),
    "max_retries": (frozenset({TASK}), _UNSET),
    "retry_exceptions": (frozenset({TASK, METHOD}), _UNSET),
    "max_restarts": (frozenset({ACTOR}), _UNSET),
    "max_task_retries": (frozenset({ACTOR, METHOD}), _UNSET),
    "max_concurrency": (frozenset({ACTOR}), _UNSET),
    "concurrency_groups": (frozenset({ACTOR}), _UNSET),
    "concurrency_group": (frozenset({METHOD}), _UNSET),
    "namespace": (frozenset({ACTOR}), _UNSET),
    "lifetime": (frozenset({ACTOR}), _UNSET),
    "get_if_exists": (frozenset({ACTOR}), _UNSET),
    # yrdask's own (Ray refuses the key, so no Ray program picks it by accident): True a
    # light actor, False a process of its own (InvokeOptions.light, docs/isolation.md).
    "yrdask_light": (frozenset({ACTOR}), _UNSET),
    # Ray options yrdask does not support: only their Ray default is accepted.
    "accelerator_type": (frozenset({TASK, ACTOR}), None),
    "object_store_memory": (frozenset({TASK, ACTOR}), None),
    "placement_group": (frozenset({TASK, ACTOR}), "default"),
    "placement_group_bundle_index": (frozenset({TASK, ACTOR}), -1),
    "placement_group_capture_child_tasks": (frozenset({TASK, ACTOR}), None),
    "label_selector": (frozenset({TASK, ACTOR}), _UNSET),
    "_metadata": (frozenset({TASK, ACTOR}), None),
    # False: the work leaves no record (list_tasks, timeline, Dask's panels)
    "enable_task_events": (frozenset({TASK, ACTOR, METHOD}), _UNSET),
    "max_calls": (frozenset({TASK}), _UNSET),
    "max_pending_calls": (frozenset({ACTOR}), -1),
    "allow_out_of_order_execution": (frozenset({ACTOR}), _UNSET),
    "_generator_backpressure_num_objects": (frozenset({TASK, METHOD}), None),
    "tensor_transport": (frozenset({METHOD}), None),
}

_WHY = {
    "accelerator_type": "ask for the node resource instead: resources={'accelerator_type:A100': "
                        "0.001} (nodes with detected GPUs offer accelerator_type:<model>)",
    "object_store_memory": "the node's object store is sized once per node "
                           "(ray.init(object_store_memory=)); a task reserves no share of it",
    "placement_group": "use scheduling_strategy=PlacementGroupSchedulingStrategy(pg, index)",
    "placement_group_bundle_index": "use scheduling_strategy=PlacementGroupSchedulingStrategy",
    "placement_group_capture_child_tasks": "use scheduling_strategy=PlacementGroupSchedulingStrategy("
                                           "pg, placement_group_capture_child_tasks=True)",
    "max_pending_calls": "yrdask does not bound an actor's queue of pending calls",
}


@dataclass
class RayOptions:
    """The result of mapping: yr options plus what the ray layer enforces itself."""

    invoke: InvokeOptions
    num_returns: Any = 1
    max_retries: int = 3
    retry_exceptions: Any = False  # bool or tuple of exception classes
    concurrency_groups: dict = field(default_factory=dict)
    resources: dict = field(default_factory=dict)  # Ray units, for get_assigned_resources
    spread: bool = False
    capture: Any = None  # the placement group whose child tasks this work captures
    group: Any = None  # the placement group this work runs in (get_placement_group_id)
    max_concurrency: int | None = None  # Ray's, which may exceed yr's concurrency bound
    max_calls: int = 0  # Ray's: a process runs this many calls of the function, then ends
    events: bool = True  # Ray's enable_task_events: False, the work leaves no record


def check_keys(options: dict, kind: str) -> None:
    """ValueError for keywords Ray does not know for ``kind``; UnsupportedOptionError for Ray
    options yrdask cannot honour (unless given their Ray default)."""
    for key, value in options.items():
        entry = _OPTIONS.get(key)
        if entry is None or kind not in entry[0]:
            valid = sorted(k for k, (kinds, _) in _OPTIONS.items() if kind in kinds)
            raise ValueError(f"Invalid option keyword {key} for {kind}s. Valid ones are {valid}.")
        default = entry[1]
        if default is not _UNSET and value != default:
            why = _WHY.get(key, "yrdask does not implement it")
            raise UnsupportedOptionError(
                f"the Ray option {key}={value!r} is not supported by yrdask.ray ({why}); "
                f"leave it at its default {default!r}")


def _number(key: str, value: Any, *, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or not math.isfinite(value):
        raise ValueError(f"The keyword '{key}' only accepts None, 0 or a positive number, "
                         f"got {value!r}.")
    return float(value)


def _retry_exceptions(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(t, type) and issubclass(t, BaseException) for t in value):
        return tuple(value)
    raise TypeError("retry_exceptions must be either a boolean or a list of exceptions, "
                    f"got {value!r}")


def to_invoke_options(options: dict, kind: str, namespace: str,
                      job_env: dict | None = None, what: str = "") -> RayOptions:
    """Map checked Ray options of a task or actor (``what``: its qualified name, for
    errors) to :class:`RayOptions` (see module doc)."""
    check_keys(options, kind)
    is_actor = kind == ACTOR
    inv = InvokeOptions()
    out = RayOptions(inv)
    cpus, memory, custom = check_resources(options)
    if cpus is None:
        cpus = 0.0 if is_actor else 1.0  # Ray: tasks hold 1 CPU, actors 0 while they run
    inv.cpu = int(round(cpus * 1000))
    out.resources["CPU"] = cpus
    inv.memory = int(math.ceil((memory or 0) / 2 ** 20))  # Ray reserves no memory unless asked
    if memory:
        out.resources["memory"] = memory
    inv.custom_resources = {k: v for k, v in custom.items() if v}
    out.resources.update(custom)
    out.events = check_task_events(options.get("enable_task_events", True))
    _runtime_env(options.get("runtime_env"), inv, job_env)
    _strategy(options.get("scheduling_strategy"), inv, out)
    _label_selector(options.get("label_selector"), inv)
    if out.group is not None:
        _check_bundle_fit(options, is_actor, out.group, what)
    if is_actor:
        _actor_options(options, inv, out, namespace)
    else:
        _task_options(options, out)
        if out.max_calls:  # Ray recycles the worker process: run it in processes that end
            inv.isolated = True
    inv.validate()
    return out


def check_resources(options: dict) -> tuple[float | None, float | None, dict[str, float]]:
    """Ray's checks of ``num_cpus``, ``memory``, ``num_gpus`` and ``resources``, made when a
    function or class is decorated or given ``.options()`` (as Ray does) and again at
    ``.remote()``; returns the CPUs, the memory and the other resources (GPU included)."""
    cpus = _number("num_cpus", options.get("num_cpus"))
    memory = _number("memory", options.get("memory"))
    gpus = _number("num_gpus", options.get("num_gpus"))
    custom: dict[str, float] = {}
    if gpus:
        custom["GPU"] = gpus
    resources = options.get("resources") or {}
    if not isinstance(resources, dict):
        raise TypeError(f"resources must be a dict of name -> amount, got {resources!r}")
    for key, amount in resources.items():
        if key in ("CPU", "GPU"):
            raise ValueError(f"Use the 'num_cpus' and 'num_gpus' keyword instead of '{key}' "
                             "in 'resources' keyword")
        if key == "memory":
            raise ValueError("Use the 'memory' keyword instead of 'memory' in 'resources'")
        custom[key] = _number(f"resources[{key!r}]", amount, allow_none=False)
    return cpus, memory, custom


def _check_bundle_fit(options: dict, is_actor: bool, group: Any, what: str) -> None:
    """Ray's check at ``.remote()``: a request that fits no bundle of its placement group
    could never run, so it is refused at once (``ValueError``, Ray's wording)."""
    request: dict[str, Any] = {}
    cpus = options.get("num_cpus")
    if cpus is not None or not is_actor:
        request["CPU"] = 1 if cpus is None else cpus
    if options.get("num_gpus"):
        request["GPU"] = options["num_gpus"]
    if options.get("memory"):
        request["memory"] = options["memory"]
    request.update(options.get("resources") or {})
    bundles = [{k: float(v) for k, v in b.items()} for b in group.bundle_specs]
    if any(all(b.get(k, 0.0) >= v for k, v in request.items()) for b in bundles):
        return
    raise ValueError(f"Cannot schedule {what} with the placement group because the resource "
                     f"request {request} cannot fit into any bundles for the placement group, "
                     f"{bundles}.")


def _task_options(options: dict, out: RayOptions) -> None:
    returns = options.get("num_returns")  # None: Ray's default (1; a generator streams)
    out.num_returns = 1 if returns is None else check_num_returns(returns)
    retries = options.get("max_retries", 3)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < -1:
        raise ValueError(f"The keyword 'max_retries' only accepts -1 (infinite), 0 or a "
                         f"positive integer, got {retries!r}")
    out.max_retries = retries
    out.retry_exceptions = _retry_exceptions(options.get("retry_exceptions", False))
    max_calls = options.get("max_calls", 0)
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
        raise ValueError(f"The keyword 'max_calls' only accepts 0 or a positive integer, "
                         f"got {max_calls!r}")
    out.max_calls = max_calls


def check_num_returns(n: Any, is_gen: bool | None = None, what: str = "") -> Any:
    """Ray's ``num_returns``: an int >= 0, ``"streaming"`` or ``"dynamic"``; the last two
    only for a generator function (``is_gen``; ``None``: not known here), refused where it
    is declared, as Ray does (``what`` names it)."""
    if n in ("streaming", "dynamic"):
        if is_gen is False:
            raise ValueError(f"num_returns={n!r} can only be used with generator functions "
                             f"(functions that use 'yield'); {what or 'the function'} is not "
                             "a generator function")
        return n
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 100:
        raise ValueError(f"The keyword 'num_returns' only accepts an int in [0, 100], "
                         f"'streaming' or 'dynamic', got {n!r}")
    return n


def _actor_options(options: dict, inv: InvokeOptions, out: RayOptions, namespace: str) -> None:
    restarts = options.get("max_restarts", 0)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < -1:
        raise ValueError(f"The keyword 'max_restarts' only accepts -1, 0 or a positive "
                         f"integer, got {restarts!r}")
    inv.recover_retry_times = restarts
    task_retries = options.get("max_task_retries", 0)
    if isinstance(task_retries, bool) or not isinstance(task_retries, int) or task_retries < -1:
        raise ValueError(f"The keyword 'max_task_retries' only accepts -1, 0 or a positive "
                         f"integer, got {task_retries!r}")
    out.max_retries = task_retries
    conc = options.get("max_concurrency")
    if conc is not None:
        if isinstance(conc, bool) or not isinstance(conc, int) or conc < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {conc!r}")
        inv.concurrency = min(conc, 1000)  # yr's bound; the host class carries more (actor.py)
        out.max_concurrency = conc
    groups = options.get("concurrency_groups") or {}
    if not isinstance(groups, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for k, v in groups.items()):
        raise ValueError(f"concurrency_groups must be a dict of group name -> int >= 1, "
                         f"got {groups!r}")
    out.concurrency_groups = dict(groups)
    name = options.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be None or a string, got: '{type(name)}'.")
        if not name:
            raise ValueError("Actor name cannot be an empty string.")
        inv.name = name
    ns = options.get("namespace")
    if ns is not None:
        check_namespace(ns)
    inv.namespace = ns or namespace
    lifetime = options.get("lifetime")
    if lifetime not in (None, "detached", "non_detached"):
        raise ValueError("actor `lifetime` argument must be one of 'detached', "
                         f"'non_detached' and 'None', got {lifetime!r}")
    if lifetime == "detached":
        inv.custom_extensions["lifecycle"] = "detached"
    get_if_exists = options.get("get_if_exists", False)
    if not isinstance(get_if_exists, bool):
        raise TypeError(f"get_if_exists must be a bool, got {get_if_exists!r}")
    if get_if_exists and not name:
        raise ValueError("The actor name must be specified to use `get_if_exists`.")
    inv.get_if_exists = get_if_exists
    light = options.get("yrdask_light")
    if light is not None and not isinstance(light, bool):
        raise TypeError(f"yrdask_light must be None or a bool, got {light!r}")
    inv.light = light


def _runtime_env(env: Any, inv: InvokeOptions, job_env: dict | None) -> None:
    merged: dict = dict(job_env or {})
    if env is not None:
        if not isinstance(env, dict):
            raise TypeError(f"runtime_env must be a dict, got {type(env).__name__}")
        other = sorted(k for k in env if k != "env_vars")
        if other:
            raise UnsupportedOptionError(
                f"runtime_env keys {other} are not supported by yrdask.ray: only "
                "runtime_env={'env_vars': {...}} is; install packages and code on the workers")
        merged.update(env.get("env_vars") or {})
    if merged:
        bad = [k for k, v in merged.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"runtime_env['env_vars'] must map str to str (bad key {bad[0]!r})")
        inv.env_vars = merged


def _strategy(strategy: Any, inv: InvokeOptions, out: RayOptions) -> None:
    from yrdask.ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                       PlacementGroupSchedulingStrategy)

    if strategy is None or strategy == "DEFAULT":
        return
    if strategy == "SPREAD":
        out.spread = True
        return
    if isinstance(strategy, NodeAffinitySchedulingStrategy):
        kind = AffinityType.PREFERRED if strategy.soft else AffinityType.REQUIRED
        inv.schedule_affinities = [Affinity(AffinityKind.RESOURCE, kind, [LabelOperator(
            OperatorType.LABEL_IN, "NODE_ID", [strategy.node_id])])]
        return
    if isinstance(strategy, PlacementGroupSchedulingStrategy):
        strategy.apply(inv)
        out.group = strategy.placement_group
        if strategy.placement_group_capture_child_tasks:
            out.capture = strategy.placement_group
        return
    raise ValueError(f"Invalid scheduling_strategy {strategy!r}: use 'DEFAULT', 'SPREAD', "
                     "NodeAffinitySchedulingStrategy or PlacementGroupSchedulingStrategy")


#: The label every node has: its id (Ray's ``ray._raylet.RAY_NODE_ID_KEY``).
NODE_ID_LABEL = "ray.io/node-id"


def _selector_op(key: str, value: Any) -> LabelOperator:
    """One entry of Ray's ``label_selector``: ``"v"`` (equals), ``"!v"`` (differs or absent),
    ``"in(a,b)"``, ``"!in(a,b)"``."""
    if not isinstance(key, str) or not key or not isinstance(value, str) or not value:
        raise ValueError(f"label_selector must map label names to non-empty strings, got "
                         f"{key!r}: {value!r}")
    negated = value.startswith("!")
    body = value[1:] if negated else value
    if body.startswith("in(") and body.endswith(")"):
        values = [v.strip() for v in body[3:-1].split(",") if v.strip()]
    else:
        values = [body]
    if not values or not all(values):
        raise ValueError(f"label_selector[{key!r}]={value!r}: expected 'v', '!v', 'in(a,b)' "
                         "or '!in(a,b)'")
    op = OperatorType.LABEL_NOT_IN if negated else OperatorType.LABEL_IN
    return LabelOperator(op, "NODE_ID" if key == NODE_ID_LABEL else key, values)


def _label_selector(selector: Any, inv: InvokeOptions) -> None:
    """Ray's ``label_selector``: the node's labels (``yrdask.worker.labels``, docs/nodes.md)
    must match every entry: one hard affinity whose conditions are AND-ed, added to each
    hard affinity already there (a node-affinity strategy), as affinities of one kind OR."""
    if selector is None or selector == {}:
        return
    if not isinstance(selector, dict):
        raise TypeError(f"label_selector must be a dict of label name -> value, got "
                        f"{type(selector).__name__}")
    ops = [_selector_op(k, v) for k, v in selector.items()]
    hard = [a for a in inv.schedule_affinities if a.affinity_kind == AffinityKind.RESOURCE
            and a.affinity_type == AffinityType.REQUIRED]
    for affinity in hard:
        affinity.label_operators = [*affinity.label_operators, *ops]
    if not hard:
        inv.schedule_affinities = [*inv.schedule_affinities, Affinity(
            AffinityKind.RESOURCE, AffinityType.REQUIRED, ops)]


def node_affinity(node_id: str, soft: bool = True) -> list:
    """A soft (or hard) affinity for one node, as the ``SPREAD`` strategy places work."""
    kind = AffinityType.PREFERRED if soft else AffinityType.REQUIRED
    return [Affinity(AffinityKind.RESOURCE, kind,
                     [LabelOperator(OperatorType.LABEL_IN, "NODE_ID", [node_id])])]


__all__ = ["RayOptions", "to_invoke_options", "check_keys", "check_num_returns",
           "check_task_events", "node_affinity"]


def check_namespace(namespace: Any) -> None:
    """Ray's rule for a namespace given to an actor or ``get_actor``: a str (TypeError
    otherwise), not empty (ValueError)."""
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be None or a string, got {type(namespace).__name__}: "
                        f"{namespace!r}")
    if not namespace:
        raise ValueError('"" is not a valid namespace. Pass None to not specify a namespace.')


def check_task_events(value: Any) -> bool:
    """Ray's ``enable_task_events``: a bool (False: the task, actor or call leaves no record
    in ``ray.util.state``, ``ray.timeline()`` or Dask's panels)."""
    if not isinstance(value, bool):
        raise TypeError(f"enable_task_events must be a bool, got {value!r}")
    return value
