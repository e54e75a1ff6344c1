"""The interface the runtime of a worker process needs from its worker agent.

The worker agent (``yrdask.worker.agent``) implements it; the runtime only ever sees this
protocol, so it never imports the worker package.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class LocalPeer(Protocol):
    """The agent's end of a call channel from code running in the same process."""

    def deliver(self, msg: dict) -> None: ...


class LocalNode(Protocol):
    """What a worker's runtime asks of the agent that hosts it."""

    worker: Any  # the dask Worker: its address, scheduler rpc and batched stream

    def local_peer(self, on_message: Callable[[dict], None]) -> LocalPeer:
        """A peer that takes this process's own call-channel messages (no socket)."""

    def store_get(self, object_id: str) -> Any:
        """The pickled large value this worker keeps for ``object_id`` (its store frames)."""

    def prefers_local(self) -> bool:
        """Whether work submitted here should be leased on this worker first."""

    def lend_slot(self, holding_id: str, blocked: bool) -> None:
        """A thread of this lease or instance blocks in ``yr.get`` (or runs again); ``""``:
        a thread with no lease (a Dask task), which lends its share of the worker."""

    def asking(self, asking: bool) -> None:
        """This process sends a lease request (``asking``) or has its answer: while it
        waits, its blocked threads lend their CPU at once (the lease may need it)."""
