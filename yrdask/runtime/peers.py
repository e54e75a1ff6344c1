"""Peer liveness of a process's runtime: which worker processes are gone, which replaced
them at the same address, how they ended, and what their loss means here.

:class:`PeerLiveness` is one part of :class:`~yrdask.runtime.runtime.Runtime` (which mixes
it in).  The scheduler's ``WORKER_LOST`` / ``WORKER_JOINED`` / ``WORKER_EXIT``, lease grants
and instance locations (a process id at an address) and broken call channels come here; the
decisions about processes at an address are :mod:`yrdask.runtime.worker_processes`' (a pure
machine), their consequences (objects lost, leases and calls requeued) the object table's,
submitter's and router's.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable

from yrdask.runtime import worker_processes as WP

EXITS_KEPT = 1000  # worker processes whose end this runtime remembers
EXIT_REASON_WAIT_S = 0.5  # how long a crash error waits to learn how the process ended


class PeerLiveness:
    """What this process knows of the other processes' lives (part of
    :class:`~yrdask.runtime.runtime.Runtime`; the attributes below are its)."""

    loop: asyncio.AbstractEventLoop
    channels: dict[str, Any]
    objects: Any
    submitter: Any
    router: Any
    worker_processes: WP.WorkerProcesses
    # how recently lost worker processes ended (WORKER_EXIT), and who waits to know
    exits: collections.OrderedDict[str, str]
    _exit_waiters: dict[str, list[Callable[[], None]]]
    lost_workers: dict[str, None]  # workers the scheduler removed (recent)
    # how often the scheduler removed a process at each address (recent), and that count
    # when the last lost channel to it was opened: a new process at the same address is
    # told apart from the one a channel was lost to (confirmed_gone)
    removals: dict[str, int]
    lost_generation: dict[str, int]
    _lost_waiters: dict[str, list[Callable[[], None]]]

    def init_peers(self) -> None:
        """Nothing known of other processes yet (the runtime's constructor calls it)."""
        self.exits = collections.OrderedDict()
        self._exit_waiters = {}
        self.lost_workers = {}
        self.removals = {}
        self.lost_generation = {}
        self._lost_waiters = {}
        self.worker_processes = WP.WorkerProcesses()

    def worker_exit(self, worker: str, how: str, server_id: str = "") -> None:
        """``WORKER_EXIT``: how the process of ``worker`` ended (its nanny told the scheduler).
        A report about a process that a newer one at that address replaced here already
        settles the errors waiting for it but is not kept (it would describe the new one)."""
        current = self.worker_processes.current.get(worker)
        self.exits[worker] = how
        while len(self.exits) > EXITS_KEPT:
            self.exits.popitem(last=False)
        for wake in self._exit_waiters.pop(worker, ()):
            wake()
        if server_id and current is not None and current != server_id:
            self.exits.pop(worker, None)

    def with_exit_reason(self, error: Any, fail: Callable[[BaseException], None]) -> None:
        """Fail with ``error`` (a crash error naming ``error.worker``) once it can say how that
        worker's process ended (:meth:`when_exit_known`)."""
        self.when_exit_known(error.worker, lambda how: fail(
            error.with_exit(how) if how else error))

    def when_exit_known(self, worker: str, then: Callable[[str | None], None],
                        wait_s: float | None = None) -> None:
        """``then(how)`` once it is known how ``worker``'s process ended: at once if known,
        else when the nanny's report arrives, or with ``None`` after ``wait_s`` without it (a
        lost host has no nanny to tell; a process that exited with code 0 is not reported);
        ``wait_s`` defaults to :data:`EXIT_REASON_WAIT_S`."""
        done = False

        def settle() -> None:
            nonlocal done
            if not done:
                done = True
                then(self.exits.get(worker))

        if not worker or worker in self.exits:
            settle()
            return

        self._exit_waiters.setdefault(worker, []).append(settle)
        self.loop.call_later(EXIT_REASON_WAIT_S if wait_s is None else wait_s, settle)

    def worker_lost(self, address: str, server_id: str = "") -> None:
        """The scheduler removed a worker: treat a channel to it as lost, socket or not; its
        borrowings end and the objects it owned can no longer be read (OwnerDiedError).
        Unless it is a process whose successor at that address this process already deals
        with (a lease reply about the new one overtook this message): then its death was
        carried out when the successor was seen, and nothing here is the dead one's."""
        for ins in self.worker_processes.handle(WP.Lost("worker-lost", address, server_id)):
            if type(ins) is WP.Gone:
                chan = self.channels.get(address)
                if chan is not None and hasattr(chan, "abort"):
                    chan.abort()
                self._process_died(address)
                self.lost_workers[address] = None
                while len(self.lost_workers) > EXITS_KEPT:
                    self.lost_workers.pop(next(iter(self.lost_workers)))
            elif type(ins) is WP.Stranger:
                # a channel opened before the current one was known may be to the dead one
                chan = self.channels.get(address)
                if (chan is not None and hasattr(chan, "abort")
                        and not self.worker_processes.live(address, chan.expect)):
                    chan.abort()

    def objects_moved(self, worker: str, to: str, object_ids: list) -> None:
        """:class:`P.ObjectsMoved`: the values ``worker`` kept are kept by ``to`` now."""
        self.objects.location_moved(worker, to, object_ids)

    def _process_died(self, address: str) -> None:
        """The process this process dealt with at ``address`` is dead: objects it owned or
        kept are lost, its borrowings end, its removal is counted (confirmed_gone)."""
        self.objects.process_died(address)
        self.objects.location_lost(address, self.submitter.reconstruct(address))
        self.removals[address] = self.removals.pop(address, 0) + 1  # (newest last)
        while len(self.removals) > EXITS_KEPT:
            gone = next(iter(self.removals))
            del self.removals[gone]
            self.lost_generation.pop(gone, None)
        for wake in self._lost_waiters.pop(address, ()):
            wake()

    def worker_seen(self, address: str, server_id: str) -> bool:
        """(loop) A lease grant, an instance location or ``WorkerJoined`` says the process
        ``server_id`` runs at ``address``.
        If this process dealt with another one there, that one is dead (Dask lists one worker
        per address): its death is carried out now, before anything of the new one is
        recorded, and the address is usable again (a ``WorkerLost`` of it that comes later
        changes nothing).  If the old one's ``WorkerLost`` was handled already, the address
        is usable again at once too, not only once ``WorkerJoined`` (on the job stream,
        which a lease reply can overtake) comes.  Returns whether it was made usable."""
        processes = self.worker_processes
        before = processes.current.get(address)
        joined = False
        for ins in processes.handle(WP.Seen("seen", address, server_id)):
            if type(ins) is WP.Superseded:
                # the removal is counted first: a locate for an instance whose channel is
                # dropped here must not wait for the new process to go (confirmed_gone)
                self._process_died(address)
                chan = self.channels.get(address)
                if chan is not None and hasattr(chan, "abort") and chan.expect != ins.new:
                    self._drop_channel(address, chan)
                joined = True
        if (before is None and not joined and processes.live(address, server_id)
                and (address in self.lost_workers or address in self.objects.counter.dead)):
            joined = True  # a new process where a lost one's death was carried out here
        if joined:
            self._joined(address)
        return joined

    def _drop_channel(self, address: str, chan: Any) -> None:
        """Drop a channel to a process known dead now, and handle its loss at once (so
        that its late loss report cannot void what is granted on the new process)."""
        chan.closed = True  # its reader reports nothing when it ends
        chan.abort()
        self.on_channel_lost(address, chan)

    def confirmed_gone(self, address: str) -> bool:
        """Has the scheduler removed the process at ``address`` that this runtime's last lost
        channel there was connected to?  (Then the process there now, if any, is another
        one: a worker restarted at the same address.)"""
        generation = self.lost_generation.get(address)
        return generation is not None and self.removals.get(address, 0) > generation

    def worker_joined(self, address: str, server_id: str = "") -> None:
        """``WORKER_JOINED``: a new process registered at the address of a lost worker.  Forget
        the old one's death (how it ended, the unreachable owner, the worker its lease
        requests avoid): objects it owned or kept stay lost, the new one is usable at once."""
        before = self.worker_processes.current.get(address)
        if self.worker_seen(address, server_id):
            return
        if before is None or before == server_id:  # (else it named no new process there)
            self._joined(address)

    def _joined(self, address: str) -> None:
        self.exits.pop(address, None)
        self.lost_workers.pop(address, None)
        self.objects.process_joined(address)
        self.submitter.worker_joined(address)

    def on_channel_lost(self, address: str, lost: Any = None) -> None:
        """A call channel to ``address`` broke (``lost``: that channel; a newer one to the
        same address stays)."""
        if lost is not None and self.channels.get(address) is not lost:
            return
        chan = self.channels.pop(address, None)
        generation = getattr(chan, "generation", None)
        if generation is not None:  # (newest last, bounded on its own: a channel can be lost
            # after its address's removal count was dropped, or to one never removed)
            self.lost_generation.pop(address, None)
            self.lost_generation[address] = generation
            while len(self.lost_generation) > EXITS_KEPT:
                self.lost_generation.pop(next(iter(self.lost_generation)))
        self.submitter.on_channel_lost(address)
        self.router.on_channel_lost(address)
