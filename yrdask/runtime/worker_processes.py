"""Which worker process this process deals with at each address (pure, no I/O).

An address names a worker process only until it dies: a nanny restarting its worker at a
fixed ``--worker-port`` (or the kernel handing a dead one's port out again) puts a new process
there.  Each worker process has a *server id*, Dask's ``Worker.id`` (the scheduler's
``WorkerState.server_id``), new for every process, and the messages that could be about
either process carry it: lease grants (``RequestLease``'s reply), instance locations
(``CreateInstance``'s and ``LocateInstance``'s replies), the call channel handshake
(``OpenChannel.expect``), ``WorkerLost``, ``WorkerJoined`` and ``WorkerExit``.  (Not to be
confused with an instance's restart count, ``InstanceSpec.incarnation``.)

Everything a process keeps per worker address (its call channel, leases, the values kept
there, borrowers there, objects owned there) belongs to the process this machine names
*current* there.  The rule that keeps that true with no per-task cost: the first word of a
new process at an address (a lease grant, an instance location, a ``WorkerJoined``) proves
the current one is gone (Dask never lists two workers at one address), so its death is
carried out at once (:class:`Superseded`), before anything of the new one is recorded.  A ``WorkerLost`` that comes
later (the job stream and the lease reply use different connections, so it can be overtaken)
names a process already dead here and changes nothing (:class:`AlreadyGone`).

Events: :class:`Seen`, :class:`Lost`.  Instructions: :class:`Superseded` (the old
process's death, then the new one is current), :class:`Gone` (the current process,
or one never heard of while none is current, died: today's full ``WorkerLost``),
:class:`AlreadyGone` (a death carried out before), :class:`Stranger` (the scheduler removed a
process this process never dealt with, while it deals with a newer one there: nothing of
what it keeps at that address is the dead one's).
"""

from __future__ import annotations

from dataclasses import dataclass

from yrdask.statemachine import Event, Instruction, Story, remember

DEAD_KEPT = 10_000  # server ids remembered as dead (a late WorkerLost of one is ignored)


@dataclass(frozen=True)
class Seen(Event):
    """The process ``server_id`` runs at ``address`` (a lease grant or an instance location
    there, or ``WorkerJoined``)."""

    address: str
    server_id: str


@dataclass(frozen=True)
class Lost(Event):
    """The scheduler removed the process ``server_id`` at ``address`` (``WorkerLost``; ``""``: a
    scheduler that did not say which process)."""

    address: str
    server_id: str


@dataclass(frozen=True)
class Superseded(Instruction):
    """``old`` at ``address`` is dead (``new`` runs there now): carry out ``old``'s death,
    then treat ``address`` as alive (``new``'s)."""

    address: str
    old: str
    new: str


@dataclass(frozen=True)
class Gone(Instruction):
    """The process this process deals with at ``address`` is dead: carry out its death."""

    address: str
    server_id: str


@dataclass(frozen=True)
class AlreadyGone(Instruction):
    """A late ``WorkerLost`` of ``server_id``: its death was carried out when its successor
    was seen; only the removal is counted."""

    address: str
    server_id: str


@dataclass(frozen=True)
class Stranger(Instruction):
    """``server_id`` at ``address`` died, but this process deals with ``current`` there (seen
    first): what it keeps at ``address`` is ``current``'s and stays."""

    address: str
    server_id: str
    current: str


class WorkerProcesses:
    """The process (server id) current at each worker address, and those known dead (see module)."""

    def __init__(self) -> None:
        self.current: dict[str, str] = {}  # address -> the server id dealt with there
        self.dead: dict[str, None] = {}  # server ids known dead (bounded, oldest first)
        self.log = Story(maxlen=10_000)

    def handle(self, event: Event) -> list[Instruction]:
        if type(event) not in (Seen, Lost):
            raise TypeError(f"unknown worker processes event {event!r}")
        sid = event.stimulus_id
        out: list[Instruction] = []
        address, server_id = event.address, event.server_id
        if type(event) is Seen:
            if server_id and server_id not in self.dead:
                old = self.current.get(address)
                self.current[address] = server_id
                if old is not None and old != server_id:
                    remember(self.dead, old, None, DEAD_KEPT)
                    out.append(Superseded(sid, address, old, server_id))
        else:  # Lost
            current = self.current.get(address)
            if server_id and server_id in self.dead:
                out.append(AlreadyGone(sid, address, server_id))
            elif server_id and current is not None and current != server_id:
                remember(self.dead, server_id, None, DEAD_KEPT)
                out.append(Stranger(sid, address, server_id, current))
            else:  # the current one, or none known (or a scheduler not naming it)
                if server_id:
                    remember(self.dead, server_id, None, DEAD_KEPT)
                self.current.pop(address, None)
                out.append(Gone(sid, address, server_id or current or ""))
        self.log.log(sid, event, (address, server_id))
        for ins in out:
            self.log.log(sid, ins, (address, server_id))
        return out

    def live(self, address: str, server_id: str) -> bool:
        """Is ``server_id`` the process current at ``address``?  (A channel opened to it is not
        dropped for another's death.)"""
        return bool(server_id) and self.current.get(address) == server_id

    def is_dead(self, server_id: str) -> bool:
        return server_id in self.dead

    def story(self, *keys: str) -> str:
        return self.log.dump(*keys)

    def validate(self) -> None:
        """No current process is also known dead."""
        for address, server_id in self.current.items():
            assert server_id not in self.dead, (address, server_id)
