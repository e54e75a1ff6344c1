"""When a worker tells the scheduler that a holding's CPU is lent: short blocks go untold.

A task (or an instance's method) that waits in ``yr.get`` lends its lease's CPU back to the
cluster (``LeaseBlocked``, ``LeaseUnblocked`` when it runs again), so that the work it waits
for can run even on a full cluster (``scheduler/leases.py``).  Most of those waits are short:
a task that submits a child to its own worker and gets it waits ~0.1 ms, far less than any
other request could use the lent CPU for.  Telling the scheduler of each cost two messages and
two lease queue steps per nested round trip, on both sides.  So :class:`LendNotices` tells it
only of a block that lasts ``delay_s`` (a timer), or at once while this worker's own
submitter waits for a lease (``Asking``; the lease it waits for may well need the CPU a
blocked parent lends, as in a chain of nested tasks on a full cluster).  A block that ends
untold ends silently; one that was told is untold (``LeaseUnblocked``) when it ends.

Capacity stays safe: an untold block only keeps the CPU counted as held a little longer than
needed (never more work on the worker than the ledger allows).  Progress stays sure: every
block that lasts is told within ``delay_s`` (``validate`` checks a timer is armed for it).

A pure state machine (``yrdask/statemachine.py``): the worker's task side
(``worker/task_side.py``) feeds it under its lock, the simulation drives the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

from yrdask.statemachine import Event, Instruction, Story, fast_init

#: how long a block lasts before the scheduler is told (``yrdask.worker.lend-delay``)
LEND_DELAY_S = 0.002


def parse_delay(raw: object) -> float:
    """``yrdask.worker.lend-delay`` in seconds: a number of seconds or a duration string such
    as ``"2ms"``; ``0`` tells every wait at once."""
    from dask.utils import parse_timedelta

    try:
        delay = parse_timedelta(raw) if raw is not None else None
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"yrdask.worker.lend-delay={raw!r} is not a duration: give seconds "
                         "or a string such as '2ms' (0 lends at once)") from e
    if delay is None or delay < 0:
        raise ValueError(f"yrdask.worker.lend-delay={raw!r} must be a duration of 0 or more "
                         "(such as '2ms'; 0 lends at once)")
    return float(delay)


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Blocked(Event):
    """A thread of holding ``holding_id`` (a lease or an instance) waits in ``yr.get``
    (``blocked``) or runs again."""

    holding_id: str
    blocked: bool
    now: float


@dataclass(frozen=True, slots=True)
class Asking(Event):
    """This worker's submitter sends a lease request (``asking``) or has its answer."""

    asking: bool


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """A timer asked for with ``WakeAt`` fired."""

    now: float


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Notify(Instruction):
    """Send ``LeaseBlocked`` (``blocked``) or ``LeaseUnblocked`` for ``holding_id``."""

    holding_id: str
    blocked: bool


@dataclass(frozen=True, slots=True)
class WakeAt(Instruction):
    """Send ``Tick(now)`` at or after ``at``."""

    at: float


# -- the machine -----------------------------------------------------------------------------


class _Hold:
    __slots__ = ("threads", "since", "told")

    def __init__(self, since: float) -> None:
        self.threads = 1  # its threads waiting in yr.get now
        self.since = since  # when the first of them began waiting
        self.told = False  # the scheduler was sent LeaseBlocked for it


class LendNotices:
    """Decides when the scheduler hears of blocks (see module docstring)."""

    def __init__(self, delay_s: float = LEND_DELAY_S, story_len: int = 10_000) -> None:
        self.delay_s = delay_s
        self.holds: dict[str, _Hold] = {}  # holdings with a thread blocked now
        self.asking = 0  # lease requests of this worker's submitter not answered yet
        self.next_wake: float | None = None  # earliest WakeAt not yet answered by a Tick
        self.story = Story(story_len)
        self._entries = self.story.entries

    # -- queries ---------------------------------------------------------------------------

    def told(self) -> set[str]:
        """The holdings whose CPU the scheduler was told is lent (and not told back)."""
        return {hid for hid, hold in self.holds.items() if hold.told}

    def story_of(self, *keys: str) -> list:
        return self.story.about(*keys)

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Apply ``event``; returns what the adapter must do, in order."""
        kind = type(event)
        if kind is Blocked:
            return self.blocked(event.stimulus_id, event.holding_id, event.blocked, event.now)
        if kind is Tick:
            return self._tick(event)
        if kind is Asking:
            return self._asking(event)
        self.story.log(event.stimulus_id, ("unknown-event", type(event).__name__), ())
        return []

    def blocked(self, sid: str, hid: str, blocked: bool, now: float) -> list[Instruction]:
        """``Blocked(sid, hid, blocked, now)`` by its fields (the task side's hot path calls
        this directly, with no event object; :meth:`handle` is the same)."""
        hold = self.holds.get(hid)
        if blocked:
            if hold is not None:  # another thread of it (an instance's) was blocked already
                hold.threads += 1
                return []
            hold = self.holds[hid] = _Hold(now)
            if self.asking or self.delay_s <= 0:
                return self._tell(sid, hid, hold)
            self._entries.append((sid, ("blocked", hid), (hid,)))
            at = now + self.delay_s
            if self.next_wake is not None and self.next_wake <= at:
                return []
            self.next_wake = at
            return [WakeAt(sid, at)]
        if hold is None:
            self.story.log(sid, ("unblock-ignored", hid), (hid,))
            return []
        hold.threads -= 1
        if hold.threads:
            return []
        del self.holds[hid]
        if not hold.told:  # the hot path: it ended before anyone heard of it
            self._entries.append((sid, ("unblocked-untold", hid), (hid,)))
            return []
        self._entries.append((sid, ("untell", hid), (hid,)))
        return [Notify(sid, hid, False)]

    def _tick(self, ev: Tick) -> list[Instruction]:
        self.next_wake = None  # the timer that brought this Tick is spent
        out: list[Instruction] = []
        earliest = None
        for hid, hold in self.holds.items():
            if hold.told:
                continue
            due = hold.since + self.delay_s
            if due <= ev.now:
                out.extend(self._tell(ev.stimulus_id, hid, hold))
            elif earliest is None or due < earliest:
                earliest = due
        if earliest is not None:
            self.next_wake = earliest
            out.append(WakeAt(ev.stimulus_id, earliest))
        return out

    def _asking(self, ev: Asking) -> list[Instruction]:
        if not ev.asking:
            self.asking = max(0, self.asking - 1)
            return []
        self.asking += 1
        out: list[Instruction] = []
        for hid, hold in self.holds.items():  # what it asks for may need their CPU
            if not hold.told:
                out.extend(self._tell(ev.stimulus_id, hid, hold))
        return out

    def _tell(self, stimulus_id: str, hid: str, hold: _Hold) -> list[Instruction]:
        hold.told = True
        self._entries.append((stimulus_id, ("tell", hid), (hid,)))
        return [Notify(stimulus_id, hid, True)]

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        """Every block is told, or will be by a timer armed for it in time."""
        assert self.asking >= 0, self.asking
        for hid, hold in self.holds.items():
            assert hold.threads > 0, (hid, hold.threads)
            if not hold.told:
                assert not self.asking, f"{hid} untold while its worker asks for a lease"
                assert self.next_wake is not None \
                    and self.next_wake <= hold.since + self.delay_s, \
                    f"{hid} blocked untold with no timer to tell it (next {self.next_wake})"


fast_init(Blocked, Asking, Tick, Notify, WakeAt)
