"""Small rules shared by tasks and actors: which exceptions Ray retries, SPREAD's next node,
yrdask's bound on reruns after a lost worker."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

from yrdask.errors import CancelledError as _YRCancelled

__all__ = ["should_retry", "rerun_items", "next_spread_node"]


def should_retry(exc: BaseException, retry_exceptions: Any) -> bool:
    """Whether Ray's ``retry_exceptions`` (bool or tuple of types) covers ``exc``."""
    if isinstance(exc, (_YRCancelled, KeyboardInterrupt, SystemExit)):
        return False
    if retry_exceptions is True:
        return isinstance(exc, Exception)
    if isinstance(retry_exceptions, tuple):
        return isinstance(exc, retry_exceptions)
    return False


def rerun_items(make: Callable[[], Iterator], again: Callable[[BaseException, int], bool]
                ) -> Iterator:
    """The items of the generator ``make()`` builds, built again after an exception for
    which ``again(exc, attempt)`` says so, as Ray retries a streaming task: a rerun's items
    the caller already received (by position) are not yielded again."""
    sent = attempt = 0
    while True:
        index = 0
        try:
            for item in make():
                if index >= sent:
                    yield item
                    sent += 1
                index += 1
            return
        except GeneratorExit:
            raise
        except BaseException as e:  # noqa: BLE001 - rerun or re-raised
            if not again(e, attempt):
                raise
            attempt += 1


_spread = {"next": 0, "at": -1.0, "nodes": []}  # round robin over the nodes, shared
_spread_lock = threading.Lock()


def next_spread_node() -> str | None:
    """The node the next ``SPREAD`` placement prefers: the nodes in turn, one process-wide
    counter (so ``.options(scheduling_strategy="SPREAD")`` copies share it); the node list
    is re-read when it is over a second old."""
    import time

    import yrdask

    now = time.monotonic()
    with _spread_lock:
        if now - _spread["at"] > 1.0:
            _spread["nodes"], _spread["at"] = [n["id"] for n in yrdask.resources()], now
        nodes = _spread["nodes"]
        if not nodes:
            return None
        _spread["next"] = (_spread["next"] + 1) % len(nodes)
        return nodes[_spread["next"]]


def captured_group(options: dict) -> Any:
    """The placement group that captures work created now with ``options``: the one the
    running task or actor was placed in with ``placement_group_capture_child_tasks=True``,
    when ``options`` name no scheduling strategy (Ray's rule); else None."""
    if options.get("scheduling_strategy") is not None:
        return None
    from yrdask.ray._context import _local, current_ctx, hosted_instance

    if getattr(_local, "ctx", None) is None and hosted_instance() is None:
        return None  # a driver's work is never captured
    return current_ctx().get("placement_group")


def with_capture(ctx: dict, group: Any) -> dict:
    """``ctx`` for work placed with ``group`` captured (or none): its children inherit it."""
    ctx = dict(ctx)
    if group is None:
        ctx.pop("placement_group", None)
    else:
        ctx["placement_group"] = group
    return ctx


def in_captured_group(options: dict, group: Any) -> dict:
    """``options`` placing work into ``group`` (any bundle) and capturing its children."""
    from yrdask.ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, -1, placement_group_capture_child_tasks=True)}
