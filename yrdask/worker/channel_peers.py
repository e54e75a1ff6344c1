"""The callers of a worker's call channels, as the worker agent answers them.

A :class:`Peer` is a caller connected by a call channel (its replies go back on that comm);
a :class:`LocalPeer` is a caller in the worker's own process (a task submitting work to its
own worker, no socket).  Tasks and instance calls answer through either alike.
"""

from __future__ import annotations

from typing import Any, Callable

from distributed.comm.core import CommClosedError

from yrdask.stream import StreamSender


def _loop_closed(on_loop: Callable) -> bool:
    """Whether the loop behind a runtime's bound ``on_loop`` is closed (the worker closed)."""
    rt = getattr(on_loop, "__self__", None)
    return rt is not None and rt.loop.is_closed()


class Peer:
    """A caller connected by a call channel; replies go back on the same comm.

    Replies come from task and instance threads; they reach the loop through the runtime's
    inbox, so a burst of results costs one loop wake-up and goes out in one write.
    """

    def __init__(self, on_loop: Callable[..., None], stream: StreamSender,
                 caller: str = "") -> None:
        self.on_loop = on_loop
        self.stream = stream
        self.caller = caller  # the caller's owner address: refs nested in results are lent to it

    def reply(self, msg: dict) -> None:
        try:
            self.on_loop(self._send, msg)
        except RuntimeError:
            if not _loop_closed(self.on_loop):
                raise
            # The worker is closing: its loop and the caller's comm are gone, and the caller
            # learns the worker's end from Dask; a task that ends now has no one to answer.

    def _send(self, msg: dict) -> None:
        try:
            self.stream.send(msg)
        except CommClosedError:
            pass


class LocalPeer:
    """A caller in this very process (a task submitting work to its own worker)."""

    def __init__(self, agent: Any, on_message: Callable[[dict], None]) -> None:
        self.agent = agent
        self.on_message = on_message
        self.caller = agent.worker.address

    def deliver(self, msg: dict) -> None:
        self.agent.dispatch(self, msg)

    def reply(self, msg: dict) -> None:
        try:
            self.agent.runtime.on_loop_later(self.on_message, msg)
        except RuntimeError:
            if not self.agent.runtime.loop.is_closed():
                raise  # else the worker is closing, and so is the caller in it (see Peer)
