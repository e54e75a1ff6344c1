"""Small rules shared by tasks and actors: which exceptions Ray retries, SPREAD's next node,
yrdask's bound on reruns after a lost worker."""

from __future__ import annotations

import threading
from typing import Any

from yrdask.errors import CancelledError as _YRCancelled

__all__ = ["should_retry", "next_spread_node"]


def should_retry(exc: BaseException, retry_exceptions: Any) -> bool:
    """Whether Ray's ``retry_exceptions`` (bool or tuple of types) covers ``exc``."""
    if isinstance(exc, (_YRCancelled, KeyboardInterrupt, SystemExit)):
        return False
    if retry_exceptions is True:
        return isinstance(exc, Exception)
    if isinstance(retry_exceptions, tuple):
        return isinstance(exc, retry_exceptions)
    return False


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
