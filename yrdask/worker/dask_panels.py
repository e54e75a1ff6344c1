"""yr work in Dask's own panels, the worker's half: record each task and method call.

yr tasks run on the agent's own threads, not in Dask's executor, so Dask sees nothing of
them by itself.  A :class:`Recorder` makes them visible the way Dask's own tasks are:

* **Profile** (``yrdask.dashboard.profile``, on by default): while a yr function runs, its
  thread is in ``worker.active_threads`` (``{thread ident: key}``, yr's key being the
  function's name), the table Dask's profiler samples every 10 ms
  (``Worker.trigger_profile``), so ``client.profile()`` and the Profile page show yr code,
  per function as for Dask keys.  The sampler holds the frames it samples for a moment:
  a task that returns meanwhile has its locals dropped on the worker's event loop when the
  sampler lets go (``Runtime.on_loop`` keeps a handle's decref behind the calls its own
  thread queued, so its instance still ends at once);
* **Task Stream** and **Progress**: each task or call that ends appends one tuple
  ``(name, id, start, stop, thread, ok)``; a periodic callback (every
  :data:`FLUSH_MS`, only when something changed) ships the batch with the running and
  queued counts per name to the scheduler (:class:`yrdask.protocol.TaskRecords`), which adds
  them to Dask's Task Stream buffer and task prefixes (``yrdask.scheduler.panels``).

The hot path pays a dict write and delete, two clock reads and a list append per call
(under 1 µs).
``yrdask.dashboard.dask-panels: false`` turns all of it off (no recorder is made).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

from yrdask import protocol as P

FLUSH_MS = 250  # how often a batch goes to the scheduler (only when something changed)
QUEUED_LISTED = 100  # queued tasks listed by id in a batch (their count is always exact)

_get_ident = threading.get_ident  # begin/end run twice per task and call: no lookups
_time = time.time


class Recorder:
    """Records the yr work of one worker for Dask's panels (module docstring)."""

    def __init__(self, agent: Any, profile: bool = False) -> None:
        self.agent = agent
        # Dask's profiler samples the threads in this table ({ident: key}); its readers hold
        # worker.active_threads_lock, but one dict write or delete is atomic under the GIL,
        # so the hot path does without the lock (Dask only copies the dict under it).
        # ``profile`` off (yrdask.dashboard.profile: false): not registered there.
        self.profile = profile
        self.active = agent.worker.active_threads if profile else {}
        self.running: dict[int, str] = {}  # thread ident -> name, while it runs yr code
        self.records: list[tuple] = []  # ended since the last flush
        # process instances' calls running now, by instance id (their CallRecords)
        self.children: dict[str, dict[str, int]] = {}
        self._sent: tuple = ({}, {}, [])  # counts and tasks in the last batch

    def begin(self, name: str, call_id: str) -> float:
        """The calling thread starts ``name`` now (for Dask's profiler, if on, as key
        ``name``: its samples group by function); returns the start time."""
        ident = _get_ident()
        self.running[ident] = name
        self.active[ident] = name  # Dask's table, or a table of our own when profile is off
        return _time()

    def drop(self) -> None:
        """The call begun in this thread never ran (cancelled first): no record."""
        ident = threading.get_ident()
        self.active.pop(ident, None)
        self.running.pop(ident, None)

    def end(self, name: str, call_id: str, start: float, ok: bool) -> None:
        """The call begun by :meth:`begin` in this thread ended (``ok``: without an error)."""
        stop = _time()
        ident = _get_ident()
        self.active.pop(ident, None)
        self.running.pop(ident, None)
        self.records.append((name, call_id, start, stop, ident, ok))

    def counts(self) -> tuple[dict[str, int], dict[str, int], list[tuple]]:
        """``(running, queued, tasks)`` now: running calls and tasks here not started yet, by
        name; and the tasks here, ``(name, task_id, started, owner)``, every running one and
        the first :data:`QUEUED_LISTED` queued ones (Ray's ``list_tasks``)."""
        running = Counter(self.running.values())
        for counts in list(self.children.values()):
            running.update(counts)
        queued: Counter = Counter()
        tasks = []
        agent = self.agent
        listed = 0
        for task_id, ex in list(agent.tasks.items()):
            msg = ex.msg
            if not msg.get("events", True):  # Ray's enable_task_events=False: not listed
                continue
            started = task_id in agent.running
            if not started:
                queued[msg["name"]] += 1
                listed += 1
                if listed > QUEUED_LISTED:
                    continue
            tasks.append((msg["name"], task_id, started, msg["owner"]))
        return dict(running), dict(queued), tasks

    def flush(self) -> None:
        """Periodic (worker loop): ship what ended and the counts, if anything changed."""
        counts = self.counts()
        n = len(self.records)  # task threads append meanwhile: take exactly these n
        records = self.records[:n]
        del self.records[:n]
        if not records and counts == self._sent:
            return
        self._sent = counts
        running, queued, tasks = counts
        self.agent.runtime.connector.stream_send(P.TaskRecords(records, running, queued,
                                                               tasks))


    def from_child(self, instance_id: str, records: list, running: dict | None) -> None:
        """A process instance's :class:`~yrdask.protocol.CallRecords` (``running`` None: the
        process is gone, nothing of it runs any more)."""
        self.records.extend(tuple(r) for r in records)
        if running:
            self.children[instance_id] = running
        else:
            self.children.pop(instance_id, None)


class ChildRecorder:
    """A process instance's own recorder: its calls for its worker's :class:`Recorder`,
    sent on the supervision channel :data:`FLUSH_MS` after something changed (no Profile:
    Dask's profiler samples the worker's threads, not this process's).

    A flush is armed by a change (a call arrived, began or ended), not ticked: an idle
    process instance never wakes up for its panels.  ``arm()`` schedules one :meth:`flush`
    (any thread)."""

    def __init__(self, send: Any, load: Any, arm: Any) -> None:
        self.send = send  # CallRecords -> the agent (False while there is no channel)
        self.load = load  # () -> (the instance's calls not answered yet, answered so far)
        self.arm = arm
        self.armed = False  # a flush is scheduled
        self.running: dict[int, str] = {}
        self.records: list[tuple] = []
        self._sent: tuple = ({}, 0, 0)

    def changed(self) -> None:
        """Something the panels show changed: a flush within :data:`FLUSH_MS` (any thread)."""
        # after the change: a flush that runs now clears ``armed`` before it looks
        if not self.armed:
            self.armed = True
            self.arm()

    def begin(self, name: str, call_id: str) -> float:
        self.running[_get_ident()] = name
        if not self.armed:
            self.changed()
        return _time()

    def drop(self) -> None:
        self.running.pop(threading.get_ident(), None)
        self.changed()

    def end(self, name: str, call_id: str, start: float, ok: bool) -> None:
        stop = _time()
        ident = _get_ident()
        self.running.pop(ident, None)
        self.records.append((name, call_id, start, stop, ident, ok))
        if not self.armed:
            self.changed()

    def flush(self) -> None:
        """Ship what ended and the running counts (the process's loop), if they changed;
        while there is no channel to the agent yet, try again later."""
        self.armed = False  # before looking: a change from now on arms the next flush
        running = dict(Counter(self.running.values()))
        pending, done = self.load()
        n = len(self.records)
        if not n and (running, pending, done) == self._sent:
            return
        records = self.records[:n]
        if self.send(P.CallRecords(records, running, pending, done).to_msg()):
            del self.records[:n]
            self._sent = (running, pending, done)
        else:
            self.changed()


def store_bytes(ids: Any, objects: str, spill: str) -> tuple[int, int]:
    """``(in shared memory, spilled to disk)``: bytes of the node-store values ``ids`` that
    one worker keeps for their owners (``agent.store``), by the size of their files in the
    node's ``objects`` and ``spill`` directories (docs/monitoring.md, "yr values in Dask's
    memory figures").  One ``stat`` per value; a value freed meanwhile counts nothing."""
    memory = disk = 0
    for oid in list(ids):
        try:
            memory += os.stat(os.path.join(objects, oid)).st_size
        except OSError:
            try:
                disk += os.stat(os.path.join(spill, oid)).st_size
            except OSError:
                pass
    return memory, disk
