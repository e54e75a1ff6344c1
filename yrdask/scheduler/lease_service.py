"""The lease adapter's decisions, apart from its I/O: what the scheduler extension does with the
lease queue's answers.

``scheduler/leases.py`` (:class:`~yrdask.scheduler.leases.LeaseQueue`) decides who gets what;
this class decides what the adapter around it does: which requests it refuses before asking
(a requester with no job stream that is no worker), which grants it releases at once (the
caller stopped waiting, or the requester is gone), where answers, revocations and timers go.
It does no I/O itself: a small :class:`LeaseServiceEdge` carries out the edge (the clock, timers,
sends to an owner, who is connected).  The Dask extension (``scheduler/extension.py``) plugs in
its loop and streams; the simulation (``tests/sim/world.py``) plugs in its virtual clock and
links, so it drives this very code.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Protocol, Sequence

from yrdask import protocol as P
from yrdask.scheduler import leases as LQ
from yrdask.scheduler.requests import LeaseRequest, freeze, shape_of
from yrdask.scheduler.resources import Shape

Answer = Callable[[list], None]

#: the stream ops :class:`LeaseService` handles itself (its methods are their handlers): the
#: extension's worker-stream and job-stream tables and the simulation's take them from it
STREAM_OPS = (P.RETURN_LEASES, P.WITHDRAW_LEASE_REQUESTS, P.LEASE_BLOCKED, P.LEASE_UNBLOCKED)


class LeaseServiceEdge(Protocol):
    """What :class:`LeaseService` needs of the world around it."""

    def now(self) -> float:
        """The clock the lease queue's deadlines are in."""

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` at (or after) ``at`` on that clock."""

    def send_to_owner(self, owner: str, msg: dict) -> None:
        """Send ``msg`` on ``owner``'s job stream (a driver) or worker stream; drop it if
        there is none."""

    def has_job(self, owner: str) -> bool:
        """``owner`` is a driver whose job stream is open."""

    def is_worker(self, owner: str) -> bool:
        """``owner`` is a worker the cluster has not removed."""

    def after_feed(self) -> None:
        """Called after every event (capacity may have changed: resource groups)."""


class LeaseService:
    """Feeds the lease queue and carries out its instructions through a :class:`LeaseServiceEdge`.

    A request is opened with :meth:`open` and an ``answer`` callback, called exactly once
    with ``[holding_id, worker]`` or ``[None, reason]`` unless the caller :meth:`close`\\ s it
    first (it stopped waiting); a grant that finds no one waiting is released at once.
    """

    def __init__(self, edge: LeaseServiceEdge, leases: LQ.LeaseQueue | None = None) -> None:
        self.edge = edge
        self.leases = leases if leases is not None else LQ.LeaseQueue()
        self._answers: dict[str, tuple[Answer, LeaseRequest]] = {}  # by request id
        # (owner, the owner's own id) -> request id, while unanswered: what a withdraw names
        self._own: dict[tuple[str, str], str] = {}
        self._request_ids = itertools.count(1)
        self._stimuli = itertools.count(1)

    # -- requests --------------------------------------------------------------------------

    def lease_request(self, owner: str, shape: Shape, local: str | None = None,
                      queue: str = "", avoid: Sequence[str] | None = None,
                      affinity: Sequence[Any] | None = None,
                      request_id: str = "") -> LeaseRequest | str:
        """What a :class:`~yrdask.protocol.RequestLease` asks for (its fields), to
        :meth:`open`; or, as a string, why it is refused before it is asked."""
        gone = self.requester_gone(owner)
        if gone is not None:
            return gone
        return LeaseRequest(owner, shape_of(shape), local=local, queue=queue,
                            avoid=tuple(avoid or ()), affinity=freeze(affinity),
                            own_id=request_id or "")

    def requester_gone(self, owner: str) -> str | None:
        """Why a lease request of ``owner`` is refused before it is asked, or None.

        A request travels on a pooled rpc connection, not on the job stream, so it can come
        after its owner's job ended (or its worker left): nobody would use or return a grant.
        """
        if self.edge.has_job(owner) or self.edge.is_worker(owner):
            return None
        return f"the requester {owner} is gone"

    def open(self, req: LeaseRequest, timeout_ms: int, answer: Answer) -> str:
        """Ask for ``req``'s resources; sets and returns ``req.request_id``.  ``answer`` may
        be called before this returns (a request that fits now is granted at once)."""
        rid = req.request_id = f"R{next(self._request_ids)}"
        self._answers[rid] = (answer, req)
        if req.own_id:
            self._own[(req.owner, req.own_id)] = rid
        try:
            self.feed(LQ.HoldRequested(
                f"request-{rid}", rid, req.owner, req.kind, req.shape, timeout_ms, req.local,
                req.queue, req.avoid, req.affinity, req.labels, req.holding_id,
                self.edge.now(), req.label, req.own_id))
        except BaseException:
            self._forget(rid)
            raise
        return rid

    def request_lease(self, answer: Answer, owner: str, shape: Shape, timeout_ms: int,
                      local: str | None = None, queue: str = "",
                      avoid: Sequence[str] | None = None,
                      affinity: Sequence[Any] | None = None, request_id: str = "") -> str:
        """:class:`~yrdask.protocol.RequestLease`'s decision, whoever waits for it (the
        extension's rpc, the simulation): ``answer`` is called once, with ``[holding_id,
        worker]`` or ``[None, reason]``: at once for an owner gone already
        (:meth:`requester_gone`), else when the lease queue grants it or refuses it (its
        ``timeout_ms`` passed, the owner withdrew it), maybe before this returns.  Returns
        the request id for :meth:`abandon` and :meth:`close` ("" if nothing was asked)."""
        req = self.lease_request(owner, shape, local, queue, avoid, affinity, request_id)
        if isinstance(req, str):
            answer([None, req])
            return ""
        return self.open(req, timeout_ms, answer)

    def abandon(self, request_id: str, answered: list | None) -> None:
        """The caller stopped waiting for ``request_id`` (its rpc was cancelled): a request
        still waiting is withdrawn (:meth:`close`), and the grant it got already
        (``answered``) is released: nobody would use or return it."""
        if request_id:
            self.close(request_id)
        if answered and answered[0] is not None:
            self.release([answered[0]])

    def close(self, request_id: str) -> None:
        """The caller stopped waiting for ``request_id``: a later grant is released, and a
        request still waiting is withdrawn."""
        self._forget(request_id)
        if request_id in self.leases.pending:
            self.feed(LQ.RequestCancelled(f"withdrawn-{request_id}", request_id))

    def _forget(self, request_id: str) -> tuple[Answer, LeaseRequest] | None:
        """The request's answer, no longer waited for (None if it was answered)."""
        entry = self._answers.pop(request_id, None)
        if entry is not None and entry[1].own_id:
            self._own.pop((entry[1].owner, entry[1].own_id), None)
        return entry

    def withdraw_lease_requests(self, owner: str, request_ids: list[str] | tuple[str, ...],
                                worker: str | None = None) -> None:
        """:class:`~yrdask.protocol.WithdrawLeaseRequests`: ``owner`` no longer wants these
        lease requests (its queue drained; ``request_ids`` are its own ids of them): each still waiting leaves the queue and is answered
        ``[None, reason]``.  One not heard of yet (the withdraw overtook it: the request
        travels on an rpc, the withdraw on the owner's stream) is remembered by the lease
        queue and refused when it comes; one answered already is left alone (a grant that
        crossed the withdraw is returned by the owner as unwanted)."""
        for own_id in request_ids:
            rid = self._own.get((owner, own_id))
            self.feed(LQ.RequestWithdrawn(f"withdraw-{rid or own_id}", rid or "", owner,
                                          own_id))

    def cancel(self, request_id: str) -> None:
        """Withdraw a waiting request (its instance ended): its answer is ``[None, reason]``.
        A request already answered is left alone."""
        self.feed(LQ.RequestCancelled(f"cancel-{request_id}", request_id))

    # -- other events ----------------------------------------------------------------------

    def release(self, holding_ids: list[str] | tuple[str, ...], what: str = "release") -> None:
        """Give holdings back (ended instances, returned leases); grant what now fits."""
        self.feed(LQ.HoldingsReleased(f"{what}-{next(self._stimuli)}", tuple(holding_ids)))

    def worker_joined(self, address: str, capacity: Shape, node: str = "", gpus: tuple = (),
                      shared: Any = None, labels: Any = None) -> None:
        """A worker process offers ``capacity`` to its ``node`` (see ``LQ.WorkerJoined``)."""
        self.feed(LQ.WorkerJoined(f"worker-joined-{next(self._stimuli)}", address, capacity,
                                  node, tuple(gpus or ()), shared,
                                  tuple(sorted((labels or {}).items()))))

    def worker_draining(self, address: str, draining: bool) -> None:
        """``address`` is drained to retire (nothing new goes there), or kept after all
        (see ``LQ.WorkerDraining``)."""
        self.feed(LQ.WorkerDraining(f"worker-draining-{next(self._stimuli)}", address,
                                    draining))

    def worker_left(self, address: str) -> None:
        """What it held is lost; the leases a submitter on it held elsewhere die with it and
        its waiting requests are refused (the lease queue's ``WorkerLeft`` does both)."""
        self.feed(LQ.WorkerLeft(f"worker-left-{next(self._stimuli)}", address))

    def owner_gone(self, owner: str) -> None:
        """The owner's job ended: its leases are released, its waiting requests refused."""
        self.feed(LQ.OwnerGone(f"owner-gone-{next(self._stimuli)}", owner))

    def return_leases(self, lease_ids: list[str] | tuple[str, ...],
                      worker: str | None = None) -> None:
        """:class:`~yrdask.protocol.ReturnLeases`: the owner is done with them."""
        self.release(lease_ids, "return")

    def lease_blocked(self, lease_id: str, worker: str | None = None) -> None:
        """:class:`~yrdask.protocol.LeaseBlocked`: its CPU is lent to the cluster."""
        self.feed(LQ.LeaseBlocked(f"blocked-{next(self._stimuli)}", lease_id))

    def lease_unblocked(self, lease_id: str, worker: str | None = None) -> None:
        """:class:`~yrdask.protocol.LeaseUnblocked`: it takes its CPU back."""
        self.feed(LQ.LeaseUnblocked(f"unblocked-{next(self._stimuli)}", lease_id))

    def tick(self) -> None:
        self.feed(LQ.Tick(f"tick-{next(self._stimuli)}", self.edge.now()))

    # -- the machine's instructions --------------------------------------------------------

    def feed(self, event: Any) -> None:
        """Hand ``event`` to the lease queue and carry out its instructions."""
        gone: list[str] = []
        edge = self.edge
        for ins in self.leases.handle(event):
            kind = type(ins)
            if kind is LQ.Granted:
                entry = self._forget(ins.request_id)
                if entry is None:
                    gone.append(ins.holding_id)  # its caller went away (or it was answered)
                    continue
                answer, req = entry
                if req.kind == "lease" and self.requester_gone(req.owner) is not None:
                    gone.append(ins.holding_id)
                    answer([None, f"the requester {req.owner} is gone"])
                else:
                    answer([ins.holding_id, ins.worker])
            elif kind is LQ.Refused:
                entry = self._forget(ins.request_id)
                if entry is not None:
                    entry[0]([None, ins.reason])
            elif kind is LQ.Revoke:
                edge.send_to_owner(ins.owner, P.RevokeLeases(list(ins.lease_ids),
                                                                   ins.keep).to_msg())
            elif kind is LQ.WakeAt:
                edge.call_at(ins.at, self.tick)
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown lease queue instruction {ins!r}")
        if gone:
            self.release(gone, "gone")
        edge.after_feed()
