"""An isolated process's wire (:class:`Endpoint`): a Dask comm listener that dispatches
each connection's requests to a handler table, as Dask's ``Server`` does, and nothing else.

Why not a ``Server``: each process instance (and each spare waiting to become one) would
build one, and a ``Server`` is made for a long-lived node: a system monitor (psutil's
counters), counters and digests, a connection pool, periodic callbacks.  Building them
costs about 3.5 ms of CPU of a process's start and about 1.5 MB of its private memory
(docs/isolation.md, "Cost").  The connections, handshakes and (de)serialization are still
Dask's (``distributed.comm``); what is left out is only what a process that serves its
instance's callers and its agent never uses.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Callable, Mapping

logger = logging.getLogger("yrdask.worker")


def _takes_comm(handler: Callable[..., Any]) -> bool:
    """Is ``handler``'s first parameter the comm (Dask's rule for its handlers)?"""
    func = getattr(handler, "__func__", handler)
    code = getattr(func, "__code__", None)
    if code is None:  # not a plain function or method
        params = list(inspect.signature(handler).parameters)
        return bool(params) and params[0] == "comm"
    names = code.co_varnames[1 if func is not handler else 0:code.co_argcount]
    return bool(names) and names[0] == "comm"


class Endpoint:
    """Listen on a Dask comm address and serve each connection's requests with ``handlers``
    (op -> handler), with a ``Server``'s message rules: ``op`` names the handler, a
    ``comm`` first parameter gets the connection (a handler may keep it: a stream), the
    result is written back unless ``reply`` is false, ``close`` ends the connection, and a
    handler's exception is answered as ``distributed.core.error_message``."""

    def __init__(self, handlers: Mapping[str, Callable[..., Any]]) -> None:
        self.handlers = dict(handlers)
        self._with_comm = {op: _takes_comm(h) for op, h in self.handlers.items()}
        self.listener: Any = None
        self.rpc: Any = None  # Dask's connection pool, once it listens
        self._serving: set = set()  # a task per open connection

    async def listen(self, address: str, **listen_args: Any) -> None:
        from distributed.comm import listen
        from distributed.core import ConnectionPool

        # this process's own requests (its prints to their driver), as a Server's ``rpc``
        self.rpc = ConnectionPool()
        await self.rpc.start()
        self.listener = listen(address, self._accept, allow_offload=True, **listen_args)
        await self.listener.start()

    @property
    def address(self) -> str:
        return self.listener.contact_address

    async def _accept(self, comm: Any) -> None:
        """A new connection (after Dask's handshake): served by a task of its own, so its
        messages wake that task alone, not the listener's too."""
        task = asyncio.ensure_future(self._serve(comm))
        self._serving.add(task)  # (the loop keeps only a weak reference to a task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, comm: Any) -> None:
        """One connection: its requests, one at a time, until it closes."""
        from distributed.comm.core import CommClosedError
        from distributed.core import error_message

        try:
            while True:
                try:
                    msg = await comm.read()
                except OSError:  # (CommClosedError is one)
                    break
                if isinstance(msg, dict):
                    op = msg.pop("op", None)
                    reply = msg.pop("reply", True)
                    close = msg.pop("close", False)
                    msg.pop("serializers", None)
                else:  # a stray message on a request connection: no handler's
                    op, reply, close, msg = None, True, False, {}
                if op == "close":
                    if reply:
                        await comm.write("OK")
                    break
                try:
                    handler = self.handlers.get(op)
                    if handler is None:
                        raise ValueError(f"an isolated process has no handler for {op!r}; "
                                         f"it serves {sorted(self.handlers)}")
                    result = (handler(comm, **msg) if self._with_comm[op]
                              else handler(**msg))
                    if inspect.iscoroutine(result):
                        result = await result
                except CommClosedError:
                    break
                except Exception as e:  # noqa: BLE001 - answered, as a Server answers it
                    logger.exception("isolated process: %s failed", op)
                    if comm.closed():
                        break
                    result = error_message(e, status="uncaught-error")
                if reply:
                    try:
                        await comm.write(result)
                    except (OSError, TypeError):
                        break
                if close:
                    break
        finally:
            if not comm.closed():
                comm.abort()
