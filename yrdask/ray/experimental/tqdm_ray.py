"""``ray.experimental.tqdm_ray.tqdm``: progress bars of tasks and actors, drawn by the driver.

As on Ray, a bar in a task or actor draws nothing where it runs: at most once per
``flush_interval_s`` (and when it closes) it prints its state as one JSON line marked with
Ray's token, and that line reaches the driver with the work's other prints (the worker's
print forwarding, ``log_to_driver``).  The driver takes those lines out of what it prints
(:data:`yrdask.api.session.LINE_HANDLERS`) and keeps one bar per bar state, each on a line of
its own, prefixed with where it runs as prints are.  With the ``tqdm`` package installed the
driver draws them with it; without it each state is written as a text line
(``(f pid=12, node=...) task 1: 40/100 it``).  A bar made in the driver is drawn there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any, Iterable, Iterator, TextIO

from yrdask.runtime.context import installed_runtime
from yrdask.ray._context import STATE

__all__ = ["RAY_TQDM_MAGIC", "instance", "tqdm"]

logger = logging.getLogger("yrdask.ray")

#: Ray's token that marks a printed line as a bar's state.
RAY_TQDM_MAGIC = "__ray_tqdm_magic_token__"
#: How such a line starts (``json.dumps`` of a state writes the token first).
LINE_PREFIX = '{"__magic_token__": "%s"' % RAY_TQDM_MAGIC


def _on_driver() -> bool:
    """True where bars are drawn: the driver (or a process yrdask never started)."""
    sess = STATE.session
    rt = installed_runtime()
    return rt is None or (sess is not None and sess.runtime is rt)


class tqdm:  # noqa: N801 - Ray's name
    """Ray's distributed ``tqdm``: the subset of tqdm's arguments Ray takes (``iterable``,
    ``desc``, ``total``, ``unit``, ``position``, ``flush_interval_s``), and ``update``,
    ``set_description``, ``refresh``, ``close``, ``n`` and ``total``."""

    DEFAULT_FLUSH_INTERVAL_SECONDS = 1.0

    def __init__(self, iterable: Iterable | None = None, desc: str | None = None,
                 total: int | None = None, unit: str | None = None,
                 position: int | None = None, flush_interval_s: float | None = None) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        self._iterable = iterable
        self._desc = desc or ""
        self._total = total
        self._unit = unit or "it"
        self._pos = position or 0
        self._uuid = uuid.uuid4().hex
        self._x = 0
        self._closed = False
        self._flush_interval_s = (self.DEFAULT_FLUSH_INTERVAL_SECONDS
                                  if flush_interval_s is None else flush_interval_s)
        self._last_flush_time = 0.0

    def set_description(self, desc: str) -> None:
        self._desc = desc
        self._dump_state()

    def update(self, n: int = 1) -> None:
        self._x += n
        self._dump_state()

    def close(self) -> None:
        self._closed = True
        self._dump_state(force_flush=True)

    def refresh(self) -> None:
        self._dump_state()

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, total: int) -> None:
        self._total = total

    @property
    def n(self) -> int:
        return self._x

    @n.setter
    def n(self, n: int) -> None:
        self._x = n

    def __iter__(self) -> Iterator:
        if self._iterable is None:
            raise ValueError("No iterable provided")
        for item in iter(self._iterable):
            self.update(1)
            yield item
        self._dump_state(force_flush=True)  # the last count, though the bar stays open

    def _state(self) -> dict:
        return {"__magic_token__": RAY_TQDM_MAGIC, "x": self._x, "pos": self._pos,
                "desc": self._desc, "total": self._total, "unit": self._unit,
                "pid": os.getpid(), "uuid": self._uuid, "closed": self._closed}

    def _dump_state(self, force_flush: bool = False) -> None:
        now = time.monotonic()
        if not force_flush and now - self._last_flush_time < self._flush_interval_s:
            return
        self._last_flush_time = now
        if _on_driver():
            instance().process_state_update(self._state())
        else:  # one write: the line and its newline reach the driver together
            sys.stdout.write(json.dumps(self._state()) + "\n")


def _real_tqdm() -> Any:
    """``tqdm.auto`` if the tqdm package is installed, else None.  Only a package counts:
    a program's own ``tqdm.py`` (Ray's example is one) is not imported, which would run it."""
    import importlib
    import importlib.util

    try:
        spec = importlib.util.find_spec("tqdm")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    try:
        return importlib.import_module("tqdm.auto")
    except ImportError:
        return None


class _Bar:
    """One bar the driver draws: a ``tqdm.tqdm`` when tqdm is installed, else text lines."""

    def __init__(self, state: dict, label: str, position: int, real: Any,
                 out: TextIO | None) -> None:
        self.state, self.label, self.position, self.out = state, label, position, out
        self.bar = None
        if real is not None:
            self.bar = real.tqdm(desc=label + state["desc"], total=state["total"],
                                 unit=state["unit"], position=position, dynamic_ncols=True,
                                 unit_scale=True, file=out)
            if state["x"]:
                self.bar.update(state["x"])
        else:
            self._write(state)

    def update(self, state: dict) -> None:
        old, self.state = self.state, state
        if self.bar is None:
            if state != old:
                self._write(state)
            return
        if state["desc"] != old["desc"]:
            self.bar.set_description(self.label + state["desc"])
        if state["total"] != old["total"]:
            self.bar.total = state["total"]
        if state["x"] != old["x"]:
            self.bar.update(state["x"] - old["x"])
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _write(self, state: dict) -> None:
        total = "?" if state["total"] is None else state["total"]
        done = " (done)" if state["closed"] else ""
        out = self.out or sys.stderr
        try:
            out.write(f"{self.label}{state['desc']}: {state['x']}/{total} {state['unit']}"
                      f"{done}\n")
            out.flush()
        except (OSError, ValueError):  # a closed stream: nothing to draw on
            pass


class _BarManager:
    """The driver's bars, by bar id: each open bar holds the lowest free line."""

    def __init__(self, out: TextIO | None = None, use_tqdm: bool = True) -> None:
        self.out = out  # None: sys.stderr when drawn (tqdm's default)
        self.lock = threading.RLock()
        self.bars: dict[str, _Bar] = {}
        self.closed = 0  # bars closed so far
        self.real: Any = None
        if use_tqdm:
            self.real = _real_tqdm()
            if self.real is None:
                logger.info("tqdm is not installed: ray.experimental.tqdm_ray's bars are "
                            "written as text lines (pip install tqdm to draw them)")

    def process_state_update(self, state: dict, source: str = "") -> None:
        """Apply one bar state (from this process, or printed by ``source``)."""
        with self.lock:
            bar = self.bars.get(state["uuid"])
            if bar is None:
                taken = {b.position for b in self.bars.values()}
                position = next(i for i in range(len(taken) + 1) if i not in taken)
                label = f"({source}) " if source else ""
                bar = self.bars[state["uuid"]] = _Bar(state, label, position, self.real,
                                                      self.out)
            else:
                bar.update(state)
            if state["closed"]:
                bar.close()
                del self.bars[state["uuid"]]
                self.closed += 1

    def process_line(self, source: str, line: str) -> None:
        """A state line printed by ``source`` (:data:`yrdask.api.session.LINE_HANDLERS`)."""
        self.process_state_update(json.loads(line), source)


_manager: _BarManager | None = None
_manager_lock = threading.Lock()


def instance() -> _BarManager:
    """This process's bar manager (made on first use)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = _BarManager()
        return _manager


def handle_line(source: str, line: str) -> None:
    """The driver's handler of bar state lines (registered by ``ray.init``)."""
    instance().process_line(source, line)
