"""The only place the API sends protocol messages: call channels and the scheduler connectors.

* :class:`Channel` - a call channel to one worker (``OPEN_CHANNEL``): Dask ``connect`` plus a
  ``StreamSender`` with no batching delay going out, and a reader feeding replies back.
* :class:`LocalChannel` - the same contract when the worker is this very process: messages
  go straight to the local agent, with no socket.
* :class:`DriverConnector` - a driver's link to the scheduler: the job stream
  (``CONNECT_JOB``) and scheduler RPCs, plus the driver's small owner server answering
  ``FETCH_OBJECT`` for objects it owns.
* :class:`WorkerConnector` - the same contract for code running inside a worker, over that
  worker's own scheduler connection.

Messages are the typed ones of :mod:`yrdask.protocol`; ``send``/``stream_send`` also take
ready wire dicts, for callers not yet converted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Union

import dask
from dask.utils import parse_timedelta
from distributed.comm import connect
from distributed.comm.core import CommClosedError
from distributed.core import ConnectionPool, Server

from yrdask import protocol as P
from yrdask.runtime import context
from yrdask.stream import StreamSender
from yrdask.errors import SchedulerLostError, YRRuntimeError

logger = logging.getLogger("yrdask.transport")

CONNECT_TIMEOUT_S = 10.0  # a channel to a dead worker fails fast (Dask's default retries 30 s)

Outgoing = Union[P.Message, dict]  # a typed message, or its wire dict


def wire(msg: Outgoing) -> dict:
    """The wire dict of ``msg`` (a dict passes through: one type check on the hot path)."""
    return msg if type(msg) is dict else msg.to_msg()


def granted(rt: Any, reply: Any) -> list:
    """A lease reply as the submitter takes it (``[lease_id, worker]`` or ``[None, reason]``),
    after telling the runtime which process the lease is on (:meth:`Runtime.worker_seen`:
    a process this one dealt with at that address before is dead, and is handled as such
    before the grant is, so a ``WorkerLost`` of it arriving later cannot void the grant)."""
    if reply[0] is not None and len(reply) > 2:
        rt.worker_seen(reply[1], reply[2])
    return [reply[0], reply[1]]


class Channel:
    """A call channel from this process to one worker (see module docstring)."""

    def __init__(self, address: str, caller: str, connection_args: dict,
                 on_message: Callable[[dict], None], on_lost: Callable[[str, Any], None],
                 expect: str = "") -> None:
        self.address = address
        self.expect = expect  # the worker process (Dask server id) meant; "": whichever is there
        self.caller = caller
        self.connection_args = connection_args
        self.on_message = on_message
        self.on_lost = on_lost
        self.sent_functions: set[str] = set()
        self.backlog: list[dict] | None = []
        self.stream: StreamSender | None = None
        self.comm: Any = None
        self.closed = False
        self.generation = 0  # the runtime's count of removals at this address when opened
        self.task = asyncio.get_running_loop().create_task(self._run())

    def send(self, msg: Outgoing) -> None:
        msg = wire(msg)
        if self.backlog is not None:
            self.backlog.append(msg)
            return
        try:
            self.stream.send(msg)
        except CommClosedError:
            pass  # the reader notices and reports the loss

    async def _run(self) -> None:
        try:
            self.comm = comm = await connect(self.address, timeout=CONNECT_TIMEOUT_S,
                                             **self.connection_args)
            await comm.write(P.OpenChannel(self.caller, self.expect).to_msg())
            self.stream = StreamSender(comm)
            backlog, self.backlog = self.backlog, None
            if backlog:
                self.stream.send(*backlog)
            while True:
                msgs = await comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    self.on_message(msg)
        except (CommClosedError, OSError, asyncio.CancelledError):
            pass
        except Exception:
            logger.exception("call channel to %s failed", self.address)
        finally:
            self.backlog = None
            if not self.closed:
                self.closed = True
                self.on_lost(self.address, self)
            if self.comm is not None and not self.comm.closed():
                self.comm.abort()

    def abort(self) -> None:
        """Drop a channel to a worker Dask has removed: the reader then reports the loss."""
        if self.comm is not None and not self.comm.closed():
            self.comm.abort()
        else:
            self.task.cancel()

    async def close(self) -> None:
        self.closed = True
        if self.stream is not None:
            try:
                await asyncio.wait_for(self.stream.close(), 2)
            except Exception:
                pass
        self.task.cancel()
        try:
            await self.task
        except BaseException:
            pass


class LocalChannel:
    """A call channel to the agent of the worker this code runs in: no socket involved."""

    def __init__(self, agent: Any, address: str, on_message: Callable[[dict], None]) -> None:
        self.address = address
        self.sent_functions: set[str] = set()
        self.closed = False
        self.peer = agent.local_peer(on_message)

    def send(self, msg: Outgoing) -> None:
        self.peer.deliver(wire(msg))

    async def close(self) -> None:
        self.closed = True


#: How long a failed scheduler rpc waits to learn whether the job stream ended as well.
STREAM_LOST_WAIT_S = 2.0


class DriverConnector:
    """A driver's link to the scheduler (job stream + RPCs) and its owner server."""

    def __init__(self, runtime: Any, scheduler_address: str, connection_args: dict,
                 listen_args: dict) -> None:
        self.rt = runtime
        self.scheduler_address = scheduler_address
        self.connection_args = connection_args
        self.listen_args = listen_args
        self.pool = ConnectionPool(limit=64, connection_args=connection_args)
        self.fetch_object = runtime.handle_fetch  # FetchObject for objects this driver owns
        self.wait_refs_removed = runtime.wait_refs_removed  # borrowing (runtime/refcount.py)
        self.refs_removed = runtime.refs_removed
        self.add_borrower = runtime.handle_add_borrower
        self.cancel_owned = runtime.handle_cancel_owned  # ray.cancel of a borrowed ref
        self.server = Server(P.handlers(P.OWNER_RPC, self))
        self.stream_handlers = P.handlers(P.DRIVER_STREAM, self)
        self.stream: StreamSender | None = None
        self.comm: Any = None
        self.reader: asyncio.Task | None = None
        self.dashboard: str | None = None
        self.session: str | None = None  # the cluster's session name (JobWelcome)
        self.lost: SchedulerLostError | None = None  # the job stream closed under us
        self.closing = False  # close() began: the stream ends because this driver does

    async def start(self, job_id: str, listen_host: str) -> str:
        """Open the owner server and the job stream; returns the owner address."""
        await self.pool.start()
        scheme = self.scheduler_address.split("://")[0] if "://" in self.scheduler_address else "tcp"
        if scheme not in ("tcp", "tls"):  # a proxy's scheme (gateway://) has no listener
            scheme = "tls" if self.listen_args.get("ssl_context") is not None else "tcp"
        await self.server.listen(f"{scheme}://{listen_host}:0", **self.listen_args)
        address = self.server.listen_address
        await self._wait_for_extension()
        self.comm = comm = await connect(self.scheduler_address, **self.connection_args)
        await comm.write(P.ConnectJob(job_id, address, P.PROTOCOL_VERSION,
                                      context.driver_api()).to_msg())
        welcome = await comm.read()
        welcome = P.JobWelcome.from_msg(
            welcome[0] if isinstance(welcome, (list, tuple)) else welcome)
        if welcome.error:
            raise YRRuntimeError(welcome.error)
        self.dashboard = welcome.dashboard
        self.session = welcome.session
        self.stream = StreamSender(comm)
        self.reader = asyncio.get_running_loop().create_task(self._read())
        return address

    async def _wait_for_extension(self) -> None:
        """Wait until the scheduler has yr's handlers (unknown ops get ``None`` back).

        A scheduler writes its address file and listens before its preloads run, so a driver
        can arrive first; a scheduler started without ``--preload yrdask`` never gets them.
        """
        loop = asyncio.get_running_loop()
        timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
        deadline = loop.time() + timeout
        while await self.request(P.ClusterInfo(instances=False)) is None:
            if loop.time() > deadline:
                raise YRRuntimeError(
                    f"the scheduler at {self.scheduler_address} has no yrdask extension: start it "
                    "with `dask scheduler --preload yrdask` (or the Dask config in "
                    "plugins/yrdask.yaml); if it was, its preload failed: the scheduler's log "
                    "says why (e.g. a yrdask.state.path it cannot use)")
            await asyncio.sleep(0.05)

    async def _read(self) -> None:
        """The scheduler's side of the job stream (:data:`yrdask.protocol.DRIVER_STREAM`)."""
        try:
            while True:
                msgs = await self.comm.read()
                for msg in msgs if isinstance(msgs, (list, tuple)) else (msgs,):
                    try:
                        P.dispatch(self.stream_handlers, msg)
                    except P.UnknownMessage as e:
                        logger.warning("job stream: ignoring unknown message %s", e)
        except asyncio.CancelledError:  # close(): this driver ends
            return
        except (CommClosedError, OSError):
            if self.closing:
                return
        self.lost = SchedulerLostError(
            f"the scheduler at {self.scheduler_address} was restarted or lost (this driver's "
            "connection to it closed), and this driver's job ended with it: its pending calls "
            "failed and new ones are refused. Call yr.finalize(), then yr.init() again to "
            "connect anew; detached instances and the KV store come back if the scheduler "
            "keeps its state (docs/faults.md, \"Scheduler restart\")")
        logger.error("yrdask: %s", self.lost)
        self.rt.scheduler_lost(self.lost)

    def task_output(self, records: Any) -> None:
        """:class:`yrdask.protocol.TaskOutput`: prints of this job's work, to this driver."""
        sink = self.rt.output_sink
        if sink is not None:
            sink(records)

    def revoke_leases(self, lease_ids: list[str], keep: bool = False) -> None:
        """:class:`yrdask.protocol.RevokeLeases` from the job stream."""
        self.rt.submitter.revoke_leases(lease_ids, keep)

    def objects_moved(self, worker: str, to: str, object_ids: list) -> None:
        """:class:`yrdask.protocol.ObjectsMoved` from the job stream."""
        self.rt.objects_moved(worker, to, object_ids)

    def worker_lost(self, worker: str, server_id: str = "") -> None:
        """:class:`yrdask.protocol.WorkerLost` from the job stream."""
        self.rt.worker_lost(worker, server_id)

    def worker_exit(self, worker: str, how: str, server_id: str = "") -> None:
        """:class:`yrdask.protocol.WorkerExit` from the job stream."""
        self.rt.worker_exit(worker, how, server_id)

    def worker_joined(self, worker: str, server_id: str = "") -> None:
        """:class:`yrdask.protocol.WorkerJoined` from the job stream."""
        self.rt.worker_joined(worker, server_id)

    def wait_warning(self, text: str) -> None:
        """:class:`yrdask.protocol.WaitWarning`: a request of this job waits long.  Logged
        here unless the scheduler runs in this process (the embedded cluster), where its
        own log line already reached this process's stderr."""
        if getattr(self.rt, "cluster", None) is None:
            logger.warning("yrdask: %s", text)

    async def request_lease(self, shape: dict, timeout_ms: int, queue: str,
                            avoid: list[str], affinity: tuple, near: str | None,
                            request_id: str = "") -> list:
        """``[lease_id, worker]`` or ``[None, reason]``; the granted worker process's server
        id goes to the runtime first (see :func:`granted`)."""
        return granted(self.rt, await self.request(P.RequestLease(
            owner=self.rt.address, shape=shape, timeout_ms=timeout_ms, local=near, queue=queue,
            avoid=avoid, affinity=affinity, request_id=request_id)))

    async def request(self, msg: P.Message) -> Any:
        """A scheduler rpc; returns its reply (``type(msg).reply_type``).  Refused once the
        job stream was lost: the scheduler there now does not know this job."""
        if self.lost is not None:
            raise SchedulerLostError(str(self.lost))
        try:
            return await P.request(self.pool(self.scheduler_address), msg)
        except (CommClosedError, OSError):
            # The scheduler may be gone: its job stream then ends too, at about the same
            # time.  Wait (bounded) to learn it, so that what is pending fails as lost.
            reader = self.reader
            if reader is not None and not self.closing:
                await asyncio.wait({reader}, timeout=STREAM_LOST_WAIT_S)
            if self.lost is not None:
                raise SchedulerLostError(str(self.lost)) from None
            raise

    async def scheduler_rpc(self, op: str, **kwargs: Any) -> Any:
        """A scheduler rpc by op name; the fields are checked against the op's message."""
        return await self.request(P.MESSAGES[op](**kwargs))

    def stream_send(self, msg: Outgoing) -> None:
        """One-way message to the scheduler on the job stream (loop thread)."""
        try:
            self.stream.send(wire(msg))
        except CommClosedError:
            pass

    def return_leases(self, lease_ids: list[str]) -> None:
        self.stream_send(P.ReturnLeases(lease_ids))

    def withdraw_lease_requests(self, request_ids: list[str]) -> None:
        self.stream_send(P.WithdrawLeaseRequests(self.rt.address, request_ids))

    def notify_blocked(self, lease_id: str, blocked: bool) -> None:
        """Drivers run no leased tasks, so there is nothing to lend."""

    def rpc(self, address: str) -> Any:
        return self.pool(address)

    async def close(self) -> None:
        self.closing = True
        if self.stream is not None:
            try:
                self.stream.send(P.CloseStream().to_msg())
                await asyncio.wait_for(self.stream.close(), 2)
            except Exception:
                pass
        if self.reader is not None:
            self.reader.cancel()
        if self.comm is not None and not self.comm.closed():
            self.comm.abort()
        await self.pool.close()
        await self.server.close()


class WorkerConnector:
    """The connector contract for code running in a worker, over the worker's own links."""

    def __init__(self, runtime: Any, worker: Any) -> None:
        self.rt = runtime
        self.worker = worker
        self.dashboard = None
        self.connection_args = worker.connection_args

    async def request_lease(self, shape: dict, timeout_ms: int, queue: str,
                            avoid: list[str], affinity: tuple, near: str | None,
                            request_id: str = "") -> list:
        """``near``: the worker to place the lease on when it fits there (the submitter
        decides: where large arguments live, else this worker while its queue is short).
        While it waits, tasks blocked here lend their CPU at once (``worker/lending.py``)."""
        agent = self.rt.agent
        agent.asking(True)
        try:
            return granted(self.rt, await self.request(P.RequestLease(
                owner=self.worker.address, shape=shape, timeout_ms=timeout_ms,
                local=near, queue=queue, avoid=avoid, affinity=affinity,
                request_id=request_id)))
        finally:
            agent.asking(False)

    async def request(self, msg: P.Message) -> Any:
        """A scheduler rpc; returns its reply (``type(msg).reply_type``)."""
        return await P.request(self.worker.scheduler, msg)

    async def scheduler_rpc(self, op: str, **kwargs: Any) -> Any:
        """A scheduler rpc by op name; the fields are checked against the op's message."""
        return await self.request(P.MESSAGES[op](**kwargs))

    def stream_send(self, msg: Outgoing) -> None:
        """One-way message to the scheduler on the worker's own stream (loop thread)."""
        try:
            self.worker.batched_stream.send(wire(msg))
        except CommClosedError:
            pass

    def return_leases(self, lease_ids: list[str]) -> None:
        self.stream_send(P.ReturnLeases(lease_ids))

    def withdraw_lease_requests(self, request_ids: list[str]) -> None:
        self.stream_send(P.WithdrawLeaseRequests(self.worker.address, request_ids))

    def notify_blocked(self, holding_id: str, blocked: bool) -> None:
        """Lend the CPU of a lease or instance while its threads wait in ``yr.get``: the
        agent frees its gate slot at once, and tells the scheduler if the wait lasts."""
        self.rt.agent.lend_slot(holding_id, blocked)  # at once, from the task's thread

    def rpc(self, address: str) -> Any:
        return self.worker.rpc(address)

    async def close(self) -> None:
        pass
