"""The checker's power, tested: rule-breaking changes the simulation must catch.

Each :class:`Mutation` breaks one rule of a machine (or of the rule an adapter relies on)
by patching the class in this process (``apply(patch)``, with ``patch(obj, name, value)``
as ``pytest``'s ``monkeypatch.setattr``), and names the world that must catch it (the task
world, ``world.py``, or the instance world, ``calls.py``) within ``budget`` seeds.  The
mutated machine's own ``validate()`` is switched off (``validate_off``), so what catches the
mutation is the world's independent checks (capacity and conservation, exactly-once
settlement, order, the end state), not the machine checking itself.

``python -m tests.sim.mutations`` runs every mutation and prints the first seed that caught
it; ``tests/sim/test_mutations.py`` holds each to its budget in CI.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

Patch = Callable[[Any, str, Any], None]


@dataclass(frozen=True)
class Mutation:
    name: str
    world: str  # "tasks" | "calls"
    what: str  # the rule it breaks
    apply: Callable[[Patch], None]
    budget: int  # seeds within which the simulation must catch it
    validate_off: tuple = ()  # (module, class name) whose validate() is switched off


def _filter_out(cls: Any, instruction: str, patch: Patch, double: bool = False) -> None:
    """``cls.handle`` drops (or, ``double``, repeats) every instruction named ``instruction``."""
    real = cls.handle

    def handle(self, event):
        out = real(self, event)
        if double:
            return out + [i for i in out if type(i).__name__ == instruction]
        return [i for i in out if type(i).__name__ != instruction]
    patch(cls, "handle", handle)


# -- the mutations ---------------------------------------------------------------------------


def _withdrawn_grant_kept(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import LeaseGranted, SubmitQueue

    real = SubmitQueue.handle

    def handle(self, ev):
        if type(ev) is LeaseGranted and self.withdrawn.pop(ev.request_id, None) is not None:
            return []  # a grant that crossed the withdraw: forgotten, never returned
        return real(self, ev)
    patch(SubmitQueue, "handle", handle)



def _group_removal_keeps_leases(patch: Patch) -> None:
    from yrdask.scheduler.groups import GroupMachine

    real = GroupMachine._remove

    def remove(self, g, reason, sid, out):
        ledger = self.ledger
        release = ledger.release

        def keep_leases(holding_id):  # the leases running in its bundles stay held
            h = ledger.holdings.get(holding_id)
            return None if h is not None and h.kind == "lease" else release(holding_id)
        ledger.release = keep_leases
        try:
            return real(self, g, reason, sid, out)
        finally:
            del ledger.release
    patch(GroupMachine, "_remove", remove)


def _group_for_gone_owner(patch: Patch) -> None:
    from yrdask.scheduler.group_adapter import GroupService

    real = GroupService.create

    def create(self, owner, *args, **kwargs):  # the owner is never taken as gone
        self.edge.requester_gone = lambda owner: None
        try:
            return real(self, owner, *args, **kwargs)
        finally:
            del self.edge.requester_gone
    patch(GroupService, "create", create)


def _bundle_fit_ignores_use(patch: Patch) -> None:
    from yrdask.scheduler.groups import GroupMachine

    patch(GroupMachine, "remaining", lambda self, b: dict(b.shape))


def _fits_ever(patch: Patch) -> None:
    from yrdask.scheduler import resources as R

    cls = getattr(R, "NodeResources", None) or R.WorkerResources
    patch(cls, "fits_now", lambda self, shape: self.could_ever_fit(shape))


def _lost_worker_leases_kept(patch: Patch) -> None:
    from yrdask.scheduler.leases import LeaseQueue

    real = LeaseQueue._worker_left

    def worker_left(self, ev):
        self._drop_owner = lambda *a, **k: None  # the leases its submitter held elsewhere stay
        try:
            return real(self, ev)
        finally:
            del self._drop_owner
    patch(LeaseQueue, "_worker_left", worker_left)


def _release_keeps_held(patch: Patch) -> None:
    from yrdask.scheduler.resources import Ledger

    real = Ledger.release

    def release(self, holding_id):
        h = self.holdings.get(holding_id)
        ws = self.workers.get(getattr(h, "node", "") or h.worker) if h is not None else None
        before = dict(ws.held) if ws is not None else None
        out = real(self, holding_id)
        if ws is not None:
            ws.held.clear()
            ws.held.update(before)  # forgets the holding but keeps its resources held
        return out
    patch(Ledger, "release", release)


def _blocked_lends_nothing(patch: Patch) -> None:
    from yrdask.scheduler.leases import LeaseQueue

    patch(LeaseQueue, "_blocked", lambda self, ev: [])


def _block_never_told(patch: Patch) -> None:
    from yrdask.worker.lending import LendNotices

    # a block that lasts is never told (the machine believes it untold: no conservation
    # check sees it; only nested work that needs the lent CPU, and hangs, shows it)
    patch(LendNotices, "_tell", lambda self, sid, hid, hold: [])


def _unblock_untold(patch: Patch) -> None:
    from yrdask.worker.lending import LendNotices, Notify

    real = LendNotices.blocked  # what handle(Blocked) and the task side's hot path call

    def blocked(self, sid, hid, blocked, now):  # a told block that ends keeps its CPU lent
        return [i for i in real(self, sid, hid, blocked, now)
                if not (type(i) is Notify and not i.blocked)]
    patch(LendNotices, "blocked", blocked)


def _unblock_forgotten(patch: Patch) -> None:
    from yrdask.scheduler.leases import LeaseQueue

    patch(LeaseQueue, "_unblocked", lambda self, ev: [])


def _submit_drops_failures(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import SubmitQueue

    _filter_out(SubmitQueue, "TaskFailed", patch)


def _submit_settles_twice(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import SubmitQueue

    _filter_out(SubmitQueue, "TaskSucceeded", patch, double=True)


def _gate_never_bounces(patch: Patch) -> None:
    from yrdask.worker.lease_gate import LeaseGate

    _filter_out(LeaseGate, "BounceTask", patch)


def _grant_twice(patch: Patch) -> None:
    from yrdask.scheduler.leases import LeaseQueue

    _filter_out(LeaseQueue, "Granted", patch, double=True)


def _requeue_behind(patch: Patch) -> None:
    from yrdask.runtime.call_order import CallOrder

    def channel_lost(self, ev, out):
        for route in list(self.routes.values()):
            if route.worker == ev.worker:
                resend = list(route.inflight.values())
                route.inflight.clear()
                route.queue.extend(resend)  # behind the queued calls, not in front
                route.worker, route.lost = None, ev.worker
                self._pump(route, ev.stimulus_id, out)
    patch(CallOrder, "_channel_lost", channel_lost)


def _calls_drop_failures(patch: Patch) -> None:
    from yrdask.runtime.call_order import CallOrder

    _filter_out(CallOrder, "CallFailed", patch)


def _release_ignores_holders(patch: Patch) -> None:
    from yrdask.scheduler.lifecycle import Lifecycle

    patch(Lifecycle, "releasable", lambda self, iid: (
        iid in self.instances and self.instances[iid].state != "DEAD"
        and self.instances[iid].refcounted))


def _owner_gone_ignored(patch: Patch) -> None:
    from yrdask.scheduler.lifecycle import Lifecycle

    patch(Lifecycle, "_owner_gone", lambda self, ev, out: None)


def _worker_lost_ignored(patch: Patch) -> None:
    from yrdask.scheduler.lifecycle import Lifecycle

    patch(Lifecycle, "_worker_lost", lambda self, ev, out: None)


def _locate_answers_unknown_at_once(patch: Patch) -> None:
    from yrdask.scheduler import lifecycle as L

    def await_creation(self, ev, out):
        out.append(L.AnswerWaiters(ev.stimulus_id, ev.instance_id, L.CREATED, None,
                                   f"instance {ev.instance_id} does not exist"))
    patch(L.Lifecycle, "_await_creation", await_creation)


def _gone_requester_served(patch: Patch) -> None:
    from yrdask.scheduler.lease_service import LeaseService

    patch(LeaseService, "requester_gone", lambda self, owner: None)


def _departure_keeps_groups(patch: Patch) -> None:
    from yrdask.scheduler.departures import Departures

    def job_ended(self, job_id, owner):  # the groups never hear of the job's end
        self.leases.owner_gone(owner)
        if self.instances is not None:
            self.instances.owner_gone(job_id, owner)
    patch(Departures, "job_ended", job_ended)


def _departure_skips_instances(patch: Patch) -> None:
    from yrdask import protocol as P
    from yrdask.scheduler.departures import Departures

    def worker_removed(self, worker, server_id=""):  # the lifecycle never hears of it
        self.leases.worker_left(worker)
        if self.groups is not None:
            self.groups.on_owner_gone(worker)
        self.edge.broadcast(P.WorkerLost(worker, server_id), but=worker)
    patch(Departures, "worker_removed", worker_removed)


def _retryable_as_final(patch: Patch) -> None:
    from yrdask.runtime.submitter import Submitter

    real = Submitter.on_task_done

    def on_task_done(self, msg):
        if msg.retryable:  # the adapter's rule "a retryable error may run again" broken
            msg = dataclasses.replace(msg, retryable=False)
        return real(self, msg)
    patch(Submitter, "on_task_done", on_task_done)


def _channel_lost_ignored(patch: Patch) -> None:
    from yrdask.runtime.submitter import Submitter

    patch(Submitter, "on_channel_lost", lambda self, worker: None)


def _bounced_kept(patch: Patch) -> None:
    from yrdask.worker.task_side import TaskSide

    real = TaskSide.feed

    def feed(self, event):
        before = dict(self.tasks)
        real(self, event)
        for task_id, ex in before.items():  # only a bounce forgets a task inside feed
            self.tasks.setdefault(task_id, ex)
    patch(TaskSide, "feed", feed)


def _end_not_told(patch: Patch) -> None:
    from yrdask.worker.task_side import TaskSide

    def finished(self, ex):
        self.running.pop(ex.task_id, None)
        if self.tasks.get(ex.task_id) is ex:
            del self.tasks[ex.task_id]  # but the gate never hears TaskEnded
    patch(TaskSide, "finished", finished)


def _failed_call_succeeds(patch: Patch) -> None:
    from yrdask.runtime import call_order as C

    real = C.CallOrder._done

    def done(self, ev, out):  # an answer whose error is an instance's end reads as success
        if ev.error is not None and "Died" in type(ev.error).__name__:
            ev = dataclasses.replace(ev, error=None)
        return real(self, ev, out)
    patch(C.CallOrder, "_done", done)


def _gate_slot_extra(patch: Patch) -> None:
    from yrdask.worker.lease_gate import LeaseGate

    real = LeaseGate.arrived

    def arrived(self, sid, task_id, lease_id, slots, now):  # counts the slots from zero
        return real(self, sid, task_id, lease_id, slots + 1, now)
    patch(LeaseGate, "arrived", arrived)


def _timer_for_later(patch: Patch) -> None:
    from yrdask.runtime.submitter import Submitter

    def wake_at(self, at):  # keeps the later of two deadlines (the comparison turned round)
        if self.closed:
            return
        if self._timer is not None:
            if self._timer_at >= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.edge.call_at(at, self._tick)
    patch(Submitter, "_wake_at", wake_at)


def _group_never_retried(patch: Patch) -> None:
    from yrdask.scheduler import groups as G

    # what freed up since its placement failed is never seen: it is not tried again
    patch(G, "_grew", lambda before, now: False)


def _release_grants_nothing(patch: Patch) -> None:
    from yrdask.scheduler.leases import LeaseQueue

    real = LeaseQueue._released

    def released(self, ev):  # what a release frees waits for the next request or tick
        self._grant_pending = lambda sid, out: None
        try:
            return real(self, ev)
        finally:
            del self._grant_pending
    patch(LeaseQueue, "_released", released)


def _router_sends_reversed(patch: Patch) -> None:
    from yrdask.runtime import call_order as C
    from yrdask.runtime.call_router import CallRouter

    real = CallRouter._do

    def do(self, instructions):
        sends = [i for i in instructions if type(i) is C.SendCall]
        if len(sends) > 1:  # the calls of one batch go out last first
            rest = [i for i in instructions if type(i) is not C.SendCall]
            instructions = sends[::-1] + rest
        return real(self, instructions)
    patch(CallRouter, "_do", do)


def _router_ignores_lost_channel(patch: Patch) -> None:
    from yrdask.runtime.call_router import CallRouter

    patch(CallRouter, "channel_lost", lambda self, worker: None)


def _manager_forgets_dead_worker(patch: Patch) -> None:
    from yrdask.scheduler.instance_service import InstanceService

    patch(InstanceService, "worker_lost", lambda self, worker: None)


def _manager_never_releases(patch: Patch) -> None:
    from yrdask.scheduler.instance_service import InstanceService

    real = InstanceService.feed

    def feed(self, event):
        edge = self.edge
        release = edge.release
        edge.release = lambda ids: None  # the ended instances' resources stay held
        try:
            return real(self, event)
        finally:
            edge.release = release
    patch(InstanceService, "feed", feed)


def _hosting_exceeds_concurrency(patch: Patch) -> None:
    from yrdask.worker.call_queue import CallQueue

    def arrived(self, item):
        if self.stopped:
            return False
        if self.ready:  # starts every call at once, whatever the concurrency
            self.running += 1
            return True
        self.waiting.append(item)
        return False
    patch(CallQueue, "arrived", arrived)


def _hosting_before_init(patch: Patch) -> None:
    from yrdask.worker.call_queue import CallQueue

    def arrived(self, item):
        if self.stopped:
            return False
        if self.running < self.concurrency and not self.waiting:  # __init__ not awaited
            self.running += 1
            return True
        self.waiting.append(item)
        return False
    patch(CallQueue, "arrived", arrived)


def _early_calls_dropped(patch: Patch) -> None:
    from yrdask.worker.instance_side import InstanceSide

    real = InstanceSide.call_method

    def call_method(self, peer, msg):
        iid = msg["instance_id"]
        if iid in self.instances or iid in self.ended:
            return real(self, peer, msg)
        return None  # a call that beat its START_INSTANCE is dropped
    patch(InstanceSide, "call_method", call_method)


def _start_after_stop(patch: Patch) -> None:
    from yrdask.worker.instance_side import InstanceSide

    real = InstanceSide.start

    def start(self, spec):  # a START that its STOP overtook hosts the instance all the same
        ended, self.ended = self.ended, {}
        try:
            return real(self, spec)
        finally:
            self.ended = ended
    patch(InstanceSide, "start", start)


def _cancel_not_kept(patch: Patch) -> None:
    from yrdask.worker.instance_side import HostedCalls

    patch(HostedCalls, "cancel_call", lambda self, call_id: call_id in self.pending)


def _cancelled_whatever_answered(patch: Patch) -> None:
    from yrdask.errors import call_cancelled
    from yrdask.runtime import call_router

    patch(call_router, "cancelled_answer",  # every cancelled call settles as cancelled
          lambda call_id, error: call_cancelled(call_id))


def _cancel_unsent_still_goes(patch: Patch) -> None:
    from yrdask.runtime import call_order as C

    real = C.CallOrder._cancelled

    def cancelled(self, ev, out):  # a call cancelled before it left is left to go
        call = self.calls.get(ev.call_id)
        route = self.routes.get(call.instance_id) if call is not None else None
        if route is not None and ev.call_id in route.inflight:
            real(self, ev, out)
    patch(C.CallOrder, "_cancelled", cancelled)


def _init_error_ignored(patch: Patch) -> None:
    from yrdask.worker.instance_side import HostedCalls

    real = HostedCalls.runs

    def runs(self, call_id):  # calls run on an object whose __init__ raised
        error, self.init_error = self.init_error, None
        try:
            return real(self, call_id)
        finally:
            self.init_error = error
    patch(HostedCalls, "runs", runs)


def _stop_keeps_calls(patch: Patch) -> None:
    from yrdask.worker.instance_side import HostedCalls

    def stop(self, reason):  # nothing starts any more, but the calls waiting never answer
        if self.stopped is not None:
            return False
        self.stopped = reason
        with self._lock:
            self.queue.stop()
        return True
    patch(HostedCalls, "stop", stop)


def _stream_rerun_restarts(patch: Patch) -> None:
    from yrdask.runtime import generators as G

    real = G.StreamState.handle

    def handle(self, event):
        if type(event) is G.ItemArrived and event.index < self.received \
                and not (self.abandoned or self.ended):
            # a rerun's items start the stream over instead of being dropped as duplicates
            self.received = event.index
            self.taken = min(self.taken, event.index)
            self.held = {i for i in self.held if i < event.index}
        return real(self, event)
    patch(G.StreamState, "handle", handle)


def _stream_keeps_duplicates(patch: Patch) -> None:
    from yrdask.runtime import generators as G

    real = G.StreamState.handle

    def handle(self, event):
        if type(event) is G.ItemArrived and event.index < self.received \
                and not (self.abandoned or self.ended):
            self.held.add(event.index)  # a rerun's duplicate kept (never to be handed out)
            return [G.KeepItem(event.stimulus_id, event.index)]
        return real(self, event)
    patch(G.StreamState, "handle", handle)


def _stream_error_swallowed(patch: Patch) -> None:
    from yrdask.runtime import generators as G

    real = G.StreamState._take

    def take(self, sid):
        ins = real(self, sid)
        if type(ins) is G.HandOutError:  # the consumer is told the end, not the error
            return G.Stop(sid)
        return ins
    patch(G.StreamState, "_take", take)


def _stream_end_kept_open(patch: Patch) -> None:
    from yrdask.runtime import generators as G

    real = G.Stream._on_end

    def on_end(self):
        real(self)
        self.rt.streams[self.call_id] = self  # the runtime keeps routing items to it
    patch(G.Stream, "_on_end", on_end)


def _task_args_let_go_when_queued(patch: Patch) -> None:
    from yrdask.runtime.submitter import Submitter

    real = Submitter._deps_ready

    def deps_ready(self, task):
        real(self, task)
        task.held = None  # its ref arguments go once it is queued, not when it ends
    patch(Submitter, "_deps_ready", deps_ready)


def _borrowers_not_recorded(patch: Patch) -> None:
    from yrdask.runtime.object_table import ObjectTable

    real = ObjectTable.on_done_refs

    def on_done_refs(self, refs):
        holder, _borrowed, nested = refs
        return real(self, [holder, [], nested])  # the refs a task kept are not counted
    patch(ObjectTable, "on_done_refs", on_done_refs)


def _contains_ignored(patch: Patch) -> None:
    from yrdask.runtime.object_table import ObjectTable

    patch(ObjectTable, "contains", lambda self, outer, inner: None)


def _process_death_ignored(patch: Patch) -> None:
    from yrdask.runtime.object_table import ObjectTable

    patch(ObjectTable, "process_died", lambda self, address: None)


def _refs_never_freed(patch: Patch) -> None:
    from yrdask.runtime.refcount import RefCounter

    _filter_out(RefCounter, "FreeObject", patch)


# -- revokes with keep and early revokes (runtime/submit_queue.py rule 4): the world's revoke
# checks (World.check_revoked_push, check_revoked_idle) catch them -------------------------


def _kept_lease_held_when_dry(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import SubmitQueue

    real = SubmitQueue._revoke

    def revoke(self, lease, back=None):  # a kept lease revoked once idle (it ran dry) is
        if lease.tasks or back is not None:  # not given back: it takes no task but stays
            return real(self, lease, back)  # held (the idle timer, if one is armed, returns
        # it lease_idle_s later); plain revokes (_revoke_ids passes ``back``) are left alone
        lease.revoked = True
        lease.kept_until = None
        lease.q.free.pop(lease.lease_id, None)
    patch(SubmitQueue, "_revoke", revoke)


def _keep_unbounded(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import SubmitQueue

    real = SubmitQueue._revoke_ids

    def revoke_ids(self, lease_ids, keep):  # keep_revoked_s ignored: kept while it has work
        bound = self.keep_revoked_s  # (for 100 s: longer than any queue's work, shorter
        if bound > 0:  # than the world's livelock bound, so that only the check catches it)
            self.keep_revoked_s = 100.0
        try:
            return real(self, lease_ids, keep)
        finally:
            self.keep_revoked_s = bound
    patch(SubmitQueue, "_revoke_ids", revoke_ids)


def _firm_revoke_kept(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import SubmitQueue

    real = SubmitQueue._revoke_ids

    def revoke_ids(self, lease_ids, keep):  # every revoke is taken as one with keep
        return real(self, lease_ids, True)
    patch(SubmitQueue, "_revoke_ids", revoke_ids)


def _early_revoke_dropped(patch: Patch) -> None:
    from yrdask.runtime.submit_queue import SubmitQueue

    real = SubmitQueue._revoke_ids

    def revoke_ids(self, lease_ids, keep):  # a revoke of a lease not granted yet is lost
        return real(self, tuple(i for i in lease_ids if i in self.leases), keep)
    patch(SubmitQueue, "_revoke_ids", revoke_ids)


def _overtaking_withdraw_forgotten(patch: Patch) -> None:
    from yrdask.scheduler.leases import LeaseQueue

    real = LeaseQueue._withdrawn

    def withdrawn(self, ev):  # a withdraw of a request not heard of yet is a no-op (as
        return real(self, ev) if ev.request_id else []  # before): it is granted later
    patch(LeaseQueue, "_withdrawn", withdrawn)


def _restarting_death_ignored(patch: Patch) -> None:
    """``Lifecycle._process_died`` ignores every death while ``RESTARTING``, the current
    incarnation's too (a restarted process that died before it came up)."""
    from yrdask import protocol as P
    from yrdask.scheduler import lifecycle as L

    real = L.Lifecycle._process_died

    def _process_died(self, ev, out):
        rec = self.instances.get(ev.instance_id)
        if rec is not None and rec.state == P.RESTARTING:
            self._log(ev.stimulus_id, "process-died-ignored", ev.instance_id, ev.worker)
            return
        real(self, ev, out)
    patch(L.Lifecycle, "_process_died", _process_died)


def _stale_alive_taken(patch: Patch) -> None:
    """``Lifecycle._started`` takes an ALIVE whatever restart of the process says it: the
    stale one of an agent's failed read of a dead process's ``__init__`` reply too."""
    import dataclasses

    from yrdask.scheduler import lifecycle as L

    real = L.Lifecycle._started

    def _started(self, ev, out):
        real(self, dataclasses.replace(ev, incarnation=-1), out)
    patch(L.Lifecycle, "_started", _started)


def _current_alive_ignored(patch: Patch) -> None:
    """``Lifecycle._started`` takes every ALIVE that names a restart for a stale one, the
    current process's too: the instance never serves."""
    from yrdask.scheduler import lifecycle as L

    real = L.Lifecycle._started

    def _started(self, ev, out):
        if ev.incarnation >= 0:
            self._log(ev.stimulus_id, "started-ignored", ev.instance_id, ev.worker)
            return
        real(self, ev, out)
    patch(L.Lifecycle, "_started", _started)


def _restart_budget_reset(patch: Patch) -> None:
    """``Lifecycle._started`` resets the restarts used once the instance serves again."""
    from yrdask.scheduler import lifecycle as L

    real = L.Lifecycle._started

    def _started(self, ev, out):
        real(self, ev, out)
        rec = self.instances.get(ev.instance_id)
        if rec is not None:
            rec.restarts = 0
    patch(L.Lifecycle, "_started", _started)


def _crash_charged_to_none(patch: Patch) -> None:
    """``charge_crash`` charges no call: every unanswered call goes again, uncharged."""
    from yrdask.runtime import call_order as C

    patch(C, "charge_crash", lambda unanswered, concurrency, charge, bound:
          (list(unanswered), []))


def _crash_charged_to_oldest(patch: Patch) -> None:
    """``charge_crash`` charges only the oldest unanswered call, whatever the concurrency."""
    from yrdask.runtime import call_order as C

    real = C.charge_crash
    patch(C, "charge_crash", lambda unanswered, concurrency, charge, bound:
          real(unanswered, 1, charge, bound))


LQ_V = ("yrdask.scheduler.leases", "LeaseQueue")
SQ_V = ("yrdask.runtime.submit_queue", "SubmitQueue")
GATE_V = ("yrdask.worker.lease_gate", "LeaseGate")
CO_V = ("yrdask.runtime.call_order", "CallOrder")
LC_V = ("yrdask.scheduler.lifecycle", "Lifecycle")
CQ_V = ("yrdask.worker.call_queue", "CallQueue")
RG_V = ("yrdask.scheduler.groups", "GroupMachine")
LEND_V = ("yrdask.worker.lending", "LendNotices")
GEN_V = ("yrdask.runtime.generators", "StreamState")
RC_V = ("yrdask.runtime.refcount", "RefCounter")

MUTATIONS: list[Mutation] = [
    Mutation("withdrawn-grant-kept", "tasks",
             "a grant that crossed its request's withdraw is neither used nor returned (leak)",
             _withdrawn_grant_kept, 500, (SQ_V,)),
    Mutation("overtaking-withdraw-forgotten", "tasks",
             "a withdraw that overtakes its lease request is forgotten: the request is "
             "granted later (and the grant returned)", _overtaking_withdraw_forgotten, 300,
             (LQ_V,)),
    Mutation("ledger-fits-ever", "tasks",
             "Ledger.choose places on a worker that could ever fit the shape, not one where it "
             "fits now", _fits_ever, 200, (LQ_V,)),
    Mutation("lost-worker-leases-kept", "tasks",
             "WorkerLeft(w) forgets w's holdings but not the leases w's submitter holds "
             "elsewhere", _lost_worker_leases_kept, 200, (LQ_V,)),
    Mutation("release-keeps-held", "tasks",
             "releasing a holding forgets it but keeps its resources held",
             _release_keeps_held, 50, (LQ_V,)),
    Mutation("blocked-lends-nothing", "tasks",
             "LeaseBlocked does not lend the blocked task's CPU (nested work deadlocks)",
             _blocked_lends_nothing, 400, (LQ_V,)),
    Mutation("unblock-forgotten", "tasks",
             "LeaseUnblocked does not take the lent CPU back (over-commit)",
             _unblock_forgotten, 400, (LQ_V,)),
    Mutation("block-never-told", "tasks",
             "a worker never tells the scheduler that a task waits in yr.get (LendNotices: "
             "nested work deadlocks)", _block_never_told, 400, (LEND_V,)),
    Mutation("unblock-untold", "tasks",
             "a worker does not tell the scheduler that a told wait ended (LendNotices: the "
             "lent CPU is never taken back)", _unblock_untold, 400, (LEND_V,)),
    Mutation("grant-twice", "tasks",
             "a request is answered twice (exactly-once of grants)", _grant_twice, 50, (LQ_V,)),
    Mutation("submit-drops-failures", "tasks",
             "the submit queue never settles a failed task (exactly-once: lost)",
             _submit_drops_failures, 200, (SQ_V,)),
    Mutation("submit-settles-twice", "tasks",
             "the submit queue settles a successful task twice (exactly-once: doubled)",
             _submit_settles_twice, 50, (SQ_V,)),
    Mutation("gate-never-bounces", "tasks",
             "the lease gate never hands back a task that waited too long (lifecycle of a "
             "pushed task)", _gate_never_bounces, 400, (GATE_V,)),
    Mutation("adapter-serves-gone-requester", "tasks",
             "the scheduler adapter (LeaseService, production code) asks for a lease of a "
             "requester whose job already ended", _gone_requester_served, 1000),
    Mutation("departure-keeps-groups", "tasks",
             "a job's end (Departures, production code) never reaches the group service: "
             "its groups outlive it", _departure_keeps_groups, 400),
    Mutation("departure-skips-instances", "calls",
             "a worker's removal (Departures, production code) never reaches the instance "
             "service: its instances are neither restarted nor ended",
             _departure_skips_instances, 400),
    Mutation("submitter-retryable-as-final", "tasks",
             "the submitter adapter (Submitter, production code) reports a retryable user "
             "error as final (retry_times ignored)", _retryable_as_final, 200),
    Mutation("submitter-channel-lost-ignored", "tasks",
             "the submitter adapter (Submitter, production code) does not tell its queue that "
             "a worker's channel broke (tasks pushed there never settle)",
             _channel_lost_ignored, 200),
    Mutation("task-side-keeps-bounced", "tasks",
             "the worker's task side (TaskSide, production code) keeps a task it handed back "
             "(its next push is refused as a duplicate)", _bounced_kept, 400),
    Mutation("task-side-end-not-told", "tasks",
             "the worker's task side (TaskSide, production code) does not tell the lease gate "
             "that a task ended (its slot stays taken)", _end_not_told, 200),
    Mutation("group-removal-keeps-leases", "tasks",
             "removing a resource group leaves the leases that ran in its bundles held",
             _group_removal_keeps_leases, 100, (RG_V,)),
    Mutation("group-for-gone-owner", "tasks",
             "the group adapter (GroupService, production code) creates a group whose owner's "
             "job already ended (its create rpc came after the job stream's end)",
             _group_for_gone_owner, 400),
    Mutation("bundle-fit-ignores-use", "tasks",
             "a request for a bundle fits against its whole reservation, not what is left of it",
             _bundle_fit_ignores_use, 100, (RG_V,)),
    Mutation("calls-requeue-behind", "calls",
             "calls lost with a worker are redelivered behind the queued ones (order)",
             _requeue_behind, 3000, (CO_V,)),
    Mutation("calls-drop-failures", "calls",
             "a failed call is never settled (exactly-once)", _calls_drop_failures, 400, (CO_V,)),
    Mutation("release-ignores-holders", "calls",
             "an instance ends for lack of handles while processes hold it",
             _release_ignores_holders, 500, (LC_V,)),
    Mutation("owner-gone-ignored", "calls",
             "a job's end does not end its non-detached instances (lifecycle)",
             _owner_gone_ignored, 400, (LC_V,)),
    Mutation("worker-lost-ignored", "calls",
             "instances on a lost worker neither restart nor end (lifecycle)",
             _worker_lost_ignored, 400, (LC_V,)),
    # the production adapters the instance world drives (their decisions, on its edges)
    Mutation("gate-slot-extra", "tasks",
             "the worker's lease gate (LeaseGate) counts a lease's slots from zero: one task "
             "more than its slots computes at once", _gate_slot_extra, 300, (GATE_V,)),
    Mutation("timer-for-later", "tasks",
             "the submitter adapter (Submitter, production code) keeps its one timer for the "
             "later of two deadlines: idle leases are held long past lease_idle_s",
             _timer_for_later, 300),
    Mutation("group-never-retried", "tasks",
             "the group machine (GroupMachine) never tries a pending group again once its "
             "placement failed: a group that fits later is never placed, its tasks end in "
             "ScheduleError", _group_never_retried, 800, (RG_V,)),
    Mutation("release-grants-nothing", "tasks",
             "the lease queue (LeaseQueue) does not try its waiting requests when leases are "
             "returned: what fits waits for the next request or timer",
             _release_grants_nothing, 300, (LQ_V,)),
    Mutation("died-call-succeeds", "calls",
             "a call answered with its instance's end (InstanceDiedError) settles as a "
             "success: the caller gets a result the instance never gave",
             _failed_call_succeeds, 300, (CO_V,)),
    Mutation("router-sends-reversed", "calls",
             "the instance router (CallRouter) sends the calls of one batch last first",
             _router_sends_reversed, 300),
    Mutation("router-ignores-lost-channel", "calls",
             "the instance router drops a broken call channel (nothing is redelivered)",
             _router_ignores_lost_channel, 300),
    Mutation("manager-forgets-dead-worker", "calls",
             "the instance manager (InstanceService) ignores a worker's removal: its "
             "instances neither restart nor end", _manager_forgets_dead_worker, 400),
    Mutation("manager-never-releases", "calls",
             "the instance manager never gives an ended instance's resources back",
             _manager_never_releases, 100),
    Mutation("hosting-exceeds-concurrency", "calls",
             "hosting (CallQueue) starts every call at once, over the instance's concurrency",
             _hosting_exceeds_concurrency, 300, (CQ_V,)),
    Mutation("hosting-before-init", "calls",
             "hosting starts calls before __init__ finished (the named concurrency=2 race)",
             _hosting_before_init, 300, (CQ_V,)),
    Mutation("instance-side-drops-early-calls", "calls",
             "the worker's instance side drops a call that beat its START_INSTANCE",
             _early_calls_dropped, 300),
    Mutation("instance-side-starts-after-stop", "calls",
             "a START_INSTANCE that its STOP overtook hosts the instance all the same (FINDINGS.md "
             "B)", _start_after_stop, 1500),
    Mutation("hosting-cancel-not-kept", "calls",
             "Ray's cancel of an actor call that has not begun lets it run (the cancel is "
             "acknowledged, not kept)", _cancel_not_kept, 300),
    Mutation("router-cancelled-whatever-answered", "calls",
             "call_router.cancelled_answer settles a cancelled call as cancelled whatever its "
             "instance answered (a value of a call that ran on is lost)",
             _cancelled_whatever_answered, 300),
    Mutation("order-cancel-unsent-still-goes", "calls",
             "CallOrder leaves a call cancelled before it was sent to go when its route is "
             "ready (its method runs, FINDINGS.md J)", _cancel_unsent_still_goes, 300, (CO_V,)),
    Mutation("hosting-init-error-ignored", "calls",
             "calls of an instance whose __init__ raised run instead of answering its error",
             _init_error_ignored, 300),
    Mutation("hosting-stop-keeps-calls", "calls",
             "a stopped hosted instance never answers the calls it had not answered",
             _stop_keeps_calls, 300),
    Mutation("locate-unknown-at-once", "calls",
             "a locate that overtook the creation answers 'does not exist' (the race of "
             "FINDINGS.md A)", _locate_answers_unknown_at_once, 1500, (LC_V,)),
    # generators (one task seed in scenario.GEN_SEEDS): the stream's machine and adapter
    Mutation("stream-rerun-restarts", "tasks",
             "a generator rerun after its worker died or it raised starts the stream over: "
             "an item is delivered twice", _stream_rerun_restarts, 200, (GEN_V,)),
    Mutation("stream-keeps-duplicates", "tasks",
             "a rerun's duplicate items are kept instead of dropped (kept for nobody)",
             _stream_keeps_duplicates, 200, (GEN_V,)),
    Mutation("stream-error-swallowed", "tasks",
             "a failed generator's consumer gets the end instead of the error",
             _stream_error_swallowed, 200, (GEN_V,)),
    Mutation("stream-end-kept-open", "tasks",
             "the stream adapter (Stream, production code) stays registered after its end",
             _stream_end_kept_open, 200),
    # ref arguments and the borrower protocol (one task seed in scenario.REF_SEEDS)
    Mutation("task-args-let-go-when-queued", "tasks",
             "the submitter adapter (Submitter, production code) lets go of a task's ref "
             "arguments once it is queued: the owner frees a ref a pending task still needs",
             _task_args_let_go_when_queued, 200),
    Mutation("borrowers-not-recorded", "tasks",
             "the object table (ObjectTable, production code) ignores the refs a task's "
             "worker kept (TaskDone.refs): the owner frees what a borrower holds",
             _borrowers_not_recorded, 200),
    Mutation("contains-ignored", "tasks",
             "the object table ignores refs nested in a result: a ref a task returned is "
             "freed before its owner reads the result (a borrower holding it through the "
             "result covers it too: only a worker's death exposes it)", _contains_ignored, 400),
    Mutation("refs-death-ignored", "tasks",
             "the object table ignores a process's death: what a dead worker borrowed is "
             "never freed", _process_death_ignored, 400),
    # revokes (runtime/submit_queue.py rule 4): keep, its bound, firm revokes, early ones
    Mutation("kept-lease-held-when-dry", "tasks",
             "a kept lease revoked once its queue runs dry takes no task but is not given "
             "back (held idle while the waiter that revoked it waits)", _kept_lease_held_when_dry,
             100, (SQ_V,)),
    Mutation("keep-unbounded", "tasks",
             "keep_revoked_s ignored: a kept lease takes its queue's tasks for as long as "
             "there are any while the waiter that revoked it waits", _keep_unbounded, 100,
             (SQ_V,)),
    Mutation("firm-revoke-kept", "tasks",
             "a firm revoke (a waiter whose queue runs nothing, a group's removal) is taken "
             "as one with keep: the lease takes more tasks", _firm_revoke_kept, 100, (SQ_V,)),
    Mutation("early-revoke-dropped", "tasks",
             "a revoke that comes before its lease's grant is dropped (as before rule 4's "
             "fix): the lease is used and kept idle as if never revoked",
             _early_revoke_dropped, 100, (SQ_V,)),
    Mutation("refs-never-freed", "tasks",
             "the reference counter never frees an object (a leak: nothing is freed at the "
             "end)", _refs_never_freed, 200, (RC_V,)),
    # process instances: their own process dies while the worker lives
    Mutation("restarting-death-ignored", "calls",
             "the lifecycle ignores a death of the current incarnation while RESTARTING (a "
             "restarted process died before it came up): the instance never restarts",
             _restarting_death_ignored, 150, (LC_V,)),
    Mutation("stale-alive-taken", "calls",
             "the lifecycle takes an ALIVE from a process instance's dead incarnation (its "
             "agent's failed read of the __init__ reply, heard after the exit): the "
             "restarting instance is marked running with that read's error",
             _stale_alive_taken, 150, (LC_V,)),
    Mutation("current-alive-ignored", "calls",
             "the lifecycle ignores the ALIVE of a process instance's current process as if "
             "stale: the instance never serves and its calls never settle",
             _current_alive_ignored, 150, (LC_V,)),
    Mutation("restart-budget-reset", "calls",
             "the lifecycle resets an instance's restarts once it serves again: it restarts "
             "past its recover_retry_times", _restart_budget_reset, 150, (LC_V,)),
    Mutation("crash-charged-to-none", "calls",
             "call_order.charge_crash charges no call when a host process dies: a call that "
             "kills its process is delivered again past max_redeliveries",
             _crash_charged_to_none, 100, (CO_V,)),
    Mutation("crash-charged-to-oldest", "calls",
             "call_order.charge_crash charges only the oldest unanswered call, not the "
             "oldest concurrency ones: a running call that kills its process goes again "
             "uncharged", _crash_charged_to_oldest, 400, (CO_V,)),
]


def _no_validate(self) -> None:
    return None


def apply(mutation: Mutation, patch: Patch) -> None:
    """Apply ``mutation`` (and switch off the mutated machines' validate()) with ``patch``."""
    import importlib

    for module, cls in mutation.validate_off:
        patch(getattr(importlib.import_module(module), cls), "validate", _no_validate)
    mutation.apply(patch)


def first_catch(mutation: Mutation, seeds: range) -> tuple[int | None, str]:
    """The first seed of ``seeds`` whose run fails with the mutation applied (it must already
    be applied), and the failure's first line."""
    from tests.sim.world import SimFailure

    if mutation.world == "calls":
        from tests.sim.calls import run_call_seed as run
    else:
        from tests.sim.replay import run_seed as run
    for seed in seeds:
        try:
            run(seed)
        except SimFailure as e:
            return seed, e.message.split("\n")[0]
    return None, ""


class _Patcher:
    """``monkeypatch.setattr`` for the command line: records and undoes."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def __call__(self, obj: Any, name: str, value: Any) -> None:
        self.saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, old in reversed(self.saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.saved.clear()


_MISSING = object()


def main() -> int:
    import os
    import sys

    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim.mutations", *sys.argv[1:]])
    missed = 0
    for m in MUTATIONS:
        p = _Patcher()
        apply(m, p)
        t0 = time.perf_counter()
        try:
            seed, line = first_catch(m, range(m.budget))
        finally:
            p.undo()
        took = time.perf_counter() - t0
        if seed is None:
            missed += 1
        print(f"{m.name:28s} {m.world:5s} caught at seed {seed} ({took:.1f} s, budget "
              f"{m.budget}): {line[:110]}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
