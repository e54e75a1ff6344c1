"""yrdask's Dask configuration keys (``yrdask.*``), with defaults from ``yrdask.yaml``.

Read with ``dask.config.get("yrdask.scheduling.local-first")``; set like any Dask key (YAML
in ``~/.config/dask``, ``DASK_YRDASK__...`` environment variables, ``dask.config.set``).
docs/scheduling.md describes each key.
"""

from __future__ import annotations

import os

import dask
import yaml

from yrdask.errors import YRValueError

_FILE = os.path.join(os.path.dirname(__file__), "yrdask.yaml")

with open(_FILE) as f:  # libyaml's loader where PyYAML has it: 0.1 ms, not 2.5 (yr.init reads
    # this before it starts the cluster, to check the keys)
    _DEFAULTS = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))

dask.config.update_defaults(_DEFAULTS)

# Short tasks with a backlog: up to 8 per lease slot in flight, and a lease takes more once
# it has room for four, so each push carries four tasks and each run of them on the worker
# answers in one write.  With a worker per core the batches are what these make them (one
# task ends at a time), and a write and a read cost ~40 times a message in them
# (docs/changelog/performance-history.md, "2026-11-26: Many workers" and
# "2026-11-27: The driver's CPU per task, and what a message costs").  The defaults of
# yrdask.scheduling.pipeline-depth / pipeline-refill (yrdask.yaml).
PIPELINE_DEPTH = 8
PIPELINE_REFILL = 4


def pipeline_settings() -> tuple[int, int]:
    """``(depth, refill)`` from ``yrdask.scheduling.pipeline-depth`` / ``pipeline-refill``;
    ``YRValueError`` naming the key for a value that is not a whole number in range."""
    depth = _whole("yrdask.scheduling.pipeline-depth", PIPELINE_DEPTH, 1)
    refill = _whole("yrdask.scheduling.pipeline-refill", PIPELINE_REFILL, 1)
    if refill > depth:
        raise YRValueError(
            f"yrdask.scheduling.pipeline-refill={refill} is more than "
            f"yrdask.scheduling.pipeline-depth={depth}: a lease never has room for that many "
            "tasks; set pipeline-refill at most pipeline-depth")
    return depth, refill


def _whole(key: str, default: int, least: int) -> int:
    value = dask.config.get(key, default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # a whole number's text (a quoted YAML value, a string set)
    if type(value) is not int or value < least:
        raise YRValueError(f"{key}={value!r}: expected a whole number, at least {least} "
                           f"(the default is {default})")
    return value


def drain_settings() -> tuple[bool, float]:
    """``(restart_unmovable, timeout_s)`` from ``yrdask.scheduling.drain-restart-unmovable``
    and ``drain-timeout`` (scale-down, docs/deploy.md); ``YRValueError`` naming the key for
    a value that is not a boolean, or not a positive duration."""
    from dask.utils import parse_timedelta

    restart = dask.config.get("yrdask.scheduling.drain-restart-unmovable", False)
    if type(restart) is not bool:
        raise YRValueError(f"yrdask.scheduling.drain-restart-unmovable={restart!r}: expected "
                           "true or false (the default is false)")
    raw = dask.config.get("yrdask.scheduling.drain-timeout", "30s")
    try:
        timeout = parse_timedelta(raw, default="s")
    except (TypeError, ValueError, KeyError):
        timeout = None
    if timeout is None or not timeout > 0:
        raise YRValueError(f"yrdask.scheduling.drain-timeout={raw!r}: expected a positive "
                           "duration such as 30s (the default)")
    return restart, float(timeout)


def light_instances() -> bool:
    """``yrdask.instances.light``: whether an instance that names no ``light`` option is a
    light one (shares a worker process) or a process instance; ``YRValueError`` naming the
    key for a value that is not a bool."""
    return _bool("yrdask.instances.light", False, "true (instances share worker processes) "
                 "or false (each instance is a process of its own)")


def warm_zygotes() -> bool:
    """``yrdask.instances.warm-zygotes``: whether the scheduler has every worker start its
    zygote once the cluster places its first process instance (docs/isolation.md, "Process
    start"); ``YRValueError`` naming the key for a value that is not a bool."""
    return _bool("yrdask.instances.warm-zygotes", True, "true or false (the default is true)")


def _bool(key: str, default: bool, expected: str) -> bool:
    value = dask.config.get(key, default)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"  # a quoted YAML value, a string set
    if type(value) is not bool:
        raise YRValueError(f"{key}={value!r}: expected {expected}")
    return value


#: the most spare processes a worker's zygote may keep (``yrdask.instances.spare-processes``)
MAX_SPARE_PROCESSES = 16


def spare_processes() -> int:
    """``yrdask.instances.spare-processes``: how many children a worker's zygote keeps forked
    and listening ahead of the next process instance (docs/isolation.md, "Cost");
    ``YRValueError`` naming the key for a value that is not a whole number from 0 to
    :data:`MAX_SPARE_PROCESSES`."""
    value = _whole("yrdask.instances.spare-processes", 1, 0)
    if value > MAX_SPARE_PROCESSES:
        raise YRValueError(
            f"yrdask.instances.spare-processes={value}: expected at most "
            f"{MAX_SPARE_PROCESSES} (each spare is a process that holds memory while it waits; "
            "the default is 1)")
    return value


def node_labels() -> dict[str, str]:
    """``yrdask.worker.labels``: the labels this worker process gives its node (Ray's node
    labels, docs/nodes.md), checked to be ``{str: str}``."""
    labels = dask.config.get("yrdask.worker.labels", None) or {}
    if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise YRValueError(f"yrdask.worker.labels={labels!r}: expected a mapping of label "
                           "names to string values, such as {\"zone\": \"us-west4\"}")
    return dict(labels)
