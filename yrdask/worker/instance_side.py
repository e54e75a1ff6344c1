"""The worker agent's instance side: what it decides about hosted instances and their calls,
apart from its I/O.

Two layers, both driven by the simulation too (``tests/sim/calls.py`` plugs in its links,
virtual executors and clock), so it runs this very code (as ``worker/task_side.py``):

* :class:`InstanceSide`, one per worker: ``START_INSTANCE``, ``CALL_METHOD``,
  ``STOP_INSTANCE``, ``CRASH_INSTANCE`` and Ray's cancel of an actor call. A crash of a light
  instance stops it here (its calls not answered die) without ending it: calls that come next
  wait for the ``START`` of its restart, or die with its ``STOP``. A ``START`` that its
  ``STOP`` overtook (the stop is an rpc, the start comes on the scheduler's stream) is
  ignored; a ``START`` for an instance hosted here already goes to it (an isolated one whose
  process died restarts); calls that beat their ``START`` wait here and go to the instance
  when it starts, or answer "died" when its ``STOP`` comes first (a cancel of one of them
  holds when it starts: it never runs); a call for an instance stopped here answers "died".
  While an instance moves away (scale-down) its new calls are held unrun; once it has left
  they, and later ones, answer "moved" (the caller sends them to its new worker); a move given
  up lets them through in order. Its :class:`InstanceSideEdge` makes the hosted instances and
  answers.
* :class:`HostedCalls`, one per instance hosted in the worker's process: which of its calls
  run, where, and how each is answered.  :class:`~yrdask.worker.call_queue.CallQueue`
  decides which start (none before ``__init__`` finished, in arrival order, at most
  ``concurrency`` at once); this class routes around it: a stopped instance answers
  "died" at once; once the class is known, calls of its ``__yr_off_loop__`` methods (Ray's
  concurrency groups) start on an executor of their own, outside the queue's concurrency
  (the ones that came before ``__init__`` finished leave the queue then); a call that
  starts runs unless the instance stopped meanwhile (the stop answered it), its
  ``__init__`` failed (it answers that error) or it was cancelled before it started (it
  answers ``CancelledError``); a cancel of a call not waiting here is not this instance's;
  a running ``async def`` call is interrupted, a running sync one runs on; a stop answers
  every call not answered yet "died", and each call is answered once.
  ``worker/hosting.py``'s ``HostedInstance`` is its own edge (the executors, the replies),
  as ``runtime/instance_router.py`` is :class:`~yrdask.runtime.call_router.CallRouter`'s.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from yrdask.worker.call_queue import CallQueue

#: how many stopped instance ids a worker remembers (a late start or call is answered by
#: them); past it, the older half is forgotten
ENDED_KEPT = 10_000


class InstanceSideEdge(Protocol):
    """What :class:`InstanceSide` needs of the world around it.  A hosted instance it gets
    from :meth:`host` has ``call(peer, msg)``, ``stop(reason)`` and, if its calls can be
    cancelled, ``cancel_call(call_id) -> bool``."""

    def host(self, spec: dict, running: Any) -> Any:
        """Host the instance of ``START_INSTANCE`` ``spec`` and return it; ``running`` is the
        instance hosted under that id already (an isolated one whose process died: restart
        it and return it), else ``None``."""

    def died(self, peer: Any, msg: dict, why: str) -> None:
        """Answer call ``msg`` with ``InstanceDiedError`` (its instance ended here: ``why``)."""

    def ignored_start(self, instance_id: str) -> None:
        """A ``START_INSTANCE`` came after its instance was stopped here (logged)."""

    def moved_away(self, peer: Any, msg: dict, to: str) -> None:
        """Answer call ``msg`` unrun with ``InstanceMovedError`` (its instance runs on
        ``to`` now: the caller sends it there)."""


class InstanceSide:
    """The instances one worker hosts (see module docstring)."""

    def __init__(self, edge: InstanceSideEdge) -> None:
        self.edge = edge
        self.instances: dict[str, Any] = {}  # instance id -> the hosted instance
        self.early: dict[str, list] = {}  # instance id -> (peer, msg) that beat its START
        self.ended: dict[str, str] = {}  # recently stopped instance -> reason
        self.early_cancels: set[str] = set()  # early calls cancelled before their START
        # scale-down (scheduler/drain.py): calls held while an instance moves, and where
        # the instances that left went
        self.held: dict[str, list] = {}  # instance id -> (peer, msg) held, in order
        self.moved: dict[str, str] = {}  # instance id -> the worker it moved to

    def start(self, spec: dict) -> Any:
        """``START_INSTANCE``: host it (its early calls go to it), or ``None`` if it was
        stopped here before (its ``STOP`` overtook this)."""
        iid = spec["instance_id"]
        if iid in self.ended:
            self.edge.ignored_start(iid)
            return None
        self.moved.pop(iid, None)  # it came back here
        inst = self.instances[iid] = self.edge.host(spec, self.instances.get(iid))
        for peer, msg in self.early.pop(iid, ()):
            inst.call(peer, msg)
            if self.early_cancels:
                call_id = msg["task_id"]
                if call_id in self.early_cancels:  # the cancel came first: it never runs
                    self.early_cancels.discard(call_id)
                    cancel_call = getattr(inst, "cancel_call", None)
                    if cancel_call is not None:
                        cancel_call(call_id)
        return inst

    def start_instance(self, spec: dict) -> None:
        """:class:`~yrdask.protocol.StartInstance` (the worker stream's handler): :meth:`start`."""
        self.start(spec)

    def call_method(self, peer: Any, msg: dict) -> None:
        """``CALL_METHOD`` (loop thread): to its instance, or it waits for its ``START``, or
        it answers "died"."""
        inst = self.instances.get(msg["instance_id"])
        if inst is not None:
            if self.held and msg["instance_id"] in self.held:  # it is moving: kept unrun
                self.held[msg["instance_id"]].append((peer, msg))
                return
            inst.call(peer, msg)
            return
        iid = msg["instance_id"]
        why = self.ended.get(iid)
        if why is not None:
            self.edge.died(peer, msg, why)
        elif iid in self.moved:
            self.edge.moved_away(peer, msg, self.moved[iid])
        else:
            self.early.setdefault(iid, []).append((peer, msg))

    def stop(self, instance_id: str, reason: str) -> Any:
        """``STOP_INSTANCE``: the instance stops (its calls not answered die), the calls
        waiting for its ``START`` die; returns the stopped instance (or ``None``)."""
        inst = self.instances.pop(instance_id, None)
        why = self.ended.setdefault(instance_id, reason)  # an isolated process's death said why
        if len(self.ended) > ENDED_KEPT:
            for key in list(self.ended)[:ENDED_KEPT // 2]:
                del self.ended[key]
        if inst is not None:
            inst.stop(reason)
        for peer, msg in self.held.pop(instance_id, ()):
            self.edge.died(peer, msg, why)
        for peer, msg in self.early.pop(instance_id, ()):
            self.early_cancels.discard(msg["task_id"])
            self.edge.died(peer, msg, why)
        return inst

    def crash(self, instance_id: str, reason: str) -> Any:
        """``CRASH_INSTANCE`` of a light instance: it stops (its calls not answered die) but
        is not ended here (see module docstring); returns it (or ``None``)."""
        inst = self.instances.pop(instance_id, None)
        if inst is not None:
            inst.stop(reason)
        return inst

    def hold(self, instance_id: str) -> Any:
        """The instance starts to move away: its calls from now on are kept unrun (the ones
        it has already go on).  Returns the hosted instance, or ``None`` if none is here."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            self.held.setdefault(instance_id, [])
        return inst

    def release(self, instance_id: str, to: str) -> Any:
        """The move ended.  ``to`` a worker: the instance left for it; the held calls and
        later ones are answered "moved" (unrun), and the instance that left is returned for
        the edge to end.  ``to`` empty: the move was given up; the held calls go to the
        instance in order (``None`` returned)."""
        calls = self.held.pop(instance_id, ())
        if not to:
            inst = self.instances.get(instance_id)
            for peer, msg in calls:
                if inst is not None:
                    inst.call(peer, msg)
                else:
                    self.edge.died(peer, msg, self.ended.get(instance_id, "it has ended"))
            return None
        inst = self.instances.pop(instance_id, None)
        self.moved[instance_id] = to
        if len(self.moved) > ENDED_KEPT:
            for key in list(self.moved)[:ENDED_KEPT // 2]:
                del self.moved[key]
        for peer, msg in calls:
            self.edge.moved_away(peer, msg, to)
        return inst

    def cancel(self, call_id: str) -> bool:
        """Ray's cancel of an actor task (``CANCEL_TASK`` for an id that is no task here):
        the instance whose call it is takes it, or it waits with the call for its ``START``;
        False if none (answered already)."""
        for inst in self.instances.values():
            cancel_call = getattr(inst, "cancel_call", None)
            if cancel_call is not None and cancel_call(call_id):
                return True
        for calls in self.early.values():
            for _peer, msg in calls:
                if msg["task_id"] == call_id:
                    self.early_cancels.add(call_id)
                    return True
        return False


#: call id -> ids of the tasks the method call submitted (noted by worker/hosting.py), until
#: it is answered: a recursive cancel of the call cancels them.
call_children: dict[str, list] = {}


class HostedCalls:
    """The calls of one hosted instance (see module docstring).  A subclass is its edge and
    provides:

    * ``_start(item)``: run call ``item`` (``(peer, msg)``) that the queue started; when it
      returns, :meth:`finished` says which call starts in its place;
    * ``_start_side(item)``: run call ``item`` of an off-loop method now, on the side
      executor (outside the queue's concurrency);
    * ``_answer_died(peer, call_id)``: answer ``InstanceDiedError`` (``self.stopped``);
    * ``_answer_init_error(call_id)``, ``_answer_cancelled(call_id)``: answer the error of
      ``__init__`` (``self.init_error``), or ``CancelledError``, through :meth:`answered`;
    * ``_interrupt(call_id)``: cancel call ``call_id`` where it runs, if that can be done
      (a running ``async def`` method: ``asyncio.CancelledError`` at its ``await``).
    """

    def __init__(self, concurrency: int) -> None:
        self.queue = CallQueue(concurrency)  # which calls run now; under _lock
        self._lock = threading.Lock()  # the loop thread adds calls, executor threads finish
        self.stopped: str | None = None  # why, once stopped
        self.init_error: Any = None  # what __init__ raised (every call answers it)
        self.pending: dict[str, Any] = {}  # call id -> peer, for calls not answered yet
        self.cancelled: set[str] = set()  # calls cancelled before their answer
        self.tries: dict[str, int] = {}  # call id -> tries its caller charged before (> 0)
        self.off_loop: frozenset = frozenset()  # methods started on the side executor
        self.calls_done = 0

    @property
    def calls_pending(self) -> int:
        """Calls here not answered yet (the agent's load report)."""
        return len(self.pending)

    def call(self, peer: Any, msg: dict) -> None:
        """A call arrived (loop thread): it waits, starts or answers "died"."""
        call_id = msg["task_id"]
        if self.stopped is not None:
            return self._answer_died(peer, call_id)
        self.pending[call_id] = peer
        if "tries" in msg:  # delivered again: its caller charged it before (rare)
            self.tries[call_id] = msg["tries"]
        item = (peer, msg)
        with self._lock:
            q = self.queue
            side = q.ready and self.off_loop and msg["method"] in self.off_loop
            start = side or q.arrived(item)
        if side:
            self._start_side(item)
        elif start:
            self._start(item)
        return None

    def constructed(self, off_loop: frozenset = frozenset()) -> None:
        """``__init__`` finished (or failed: ``init_error``): the early calls of the
        ``off_loop`` methods go to the side executor, the others start as the queue says."""
        with self._lock:
            self.off_loop = off_loop
            side = self.queue.take(lambda item: item[1]["method"] in off_loop) \
                if off_loop else ()
            starts = self.queue.constructed()
        for item in side:
            if self.stopped is None:
                self._start_side(item)
        for item in starts:
            self._start(item)

    def finished(self) -> Any:
        """A call the queue started returned (any thread): the call to run in its place."""
        with self._lock:
            return self.queue.finished()

    def runs(self, call_id: str) -> bool:
        """A started call is about to run: False if it must not (answered here, or by the
        stop)."""
        if self.stopped is not None:
            return False
        if self.init_error is not None:
            self._answer_init_error(call_id)
            return False
        if self.cancelled and call_id in self.cancelled:  # cancelled before it started
            self._answer_cancelled(call_id)
            return False
        return True

    def answered(self, call_id: str) -> Any:
        """Call ``call_id`` answers now: its peer, or ``None`` if it was answered already
        (the stop answered it)."""
        peer = self.pending.pop(call_id, None)
        if self.cancelled:
            self.cancelled.discard(call_id)
        if self.tries:
            self.tries.pop(call_id, None)
        if call_children:
            call_children.pop(call_id, None)
        if peer is not None:
            self.calls_done += 1
        return peer

    def cancel_call(self, call_id: str) -> bool:
        """Ray's cancel of an actor task: a call not started is answered unrun (:meth:`runs`),
        a running one is interrupted where that can be done.  False if ``call_id`` is no call
        waiting for its answer here."""
        if call_id not in self.pending:
            return False
        self.cancelled.add(call_id)
        self._interrupt(call_id)
        return True

    def stop(self, reason: str) -> bool:
        """Nothing starts any more and every call not answered yet answers "died"; False if
        it had stopped already."""
        if self.stopped is not None:
            return False
        self.stopped = reason
        with self._lock:
            self.queue.stop()  # the waiting calls are in pending too
        pending = list(self.pending.items())
        self.pending.clear()
        for call_id, peer in pending:
            self._answer_died(peer, call_id)
        return True

    # -- the edge (a subclass's) -----------------------------------------------------------

    def _start(self, item: tuple) -> None:  # pragma: no cover - the subclass's
        raise NotImplementedError

    def _start_side(self, item: tuple) -> None:  # pragma: no cover
        raise NotImplementedError

    def _answer_died(self, peer: Any, call_id: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def _answer_init_error(self, call_id: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def _answer_cancelled(self, call_id: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def _interrupt(self, call_id: str) -> None:  # pragma: no cover
        raise NotImplementedError
