"""The isolated process's wire (``worker/isolated/endpoint.py``): a Dask comm listener that
answers requests by a ``Server``'s rules, over real TCP comms in this process; and its panel
recorder (``dask_panels.ChildRecorder``), which flushes after a change instead of ticking."""

from __future__ import annotations

import asyncio

import pytest
from distributed.comm import connect
from distributed.core import rpc

from yrdask.worker.dask_panels import ChildRecorder
from yrdask.worker.isolated.endpoint import Endpoint

pytestmark = pytest.mark.timeout(30)


class Handlers:
    def __init__(self) -> None:
        self.seen: list = []
        self.streamed: list = []

    def add(self, x: int, y: int = 1) -> int:
        return x + y

    async def later(self, x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    def note(self, what: str) -> None:
        self.seen.append(what)

    def boom(self) -> None:
        raise KeyError("no such thing")

    async def stream(self, comm, first: str) -> None:
        """Keeps the connection: reads what comes on it until it closes."""
        self.streamed.append(first)
        while True:
            try:
                self.streamed.append(await comm.read())
            except OSError:
                return


def serve(handlers: Handlers) -> Endpoint:
    return Endpoint({"add": handlers.add, "later": handlers.later, "note": handlers.note,
                     "boom": handlers.boom, "stream": handlers.stream})


def test_requests_are_answered_as_a_dask_server_answers_them():
    async def main() -> None:
        h = Handlers()
        ep = serve(h)
        await ep.listen("tcp://127.0.0.1:0")
        try:
            await exchange(ep, h)
        finally:
            ep.listener.stop()
            await ep.rpc.close()

    async def exchange(ep: Endpoint, h: Handlers) -> None:
        assert ep.address.startswith("tcp://127.0.0.1:")
        async with rpc(ep.address) as remote:  # Dask's own client side
            assert await remote.add(x=2) == 3
            assert await remote.add(x=2, y=5) == 7
            assert await remote.later(x=21) == 42  # a coroutine handler is awaited
            # a handler that raises: Dask's error_message, re-raised by Dask's rpc
            with pytest.raises(KeyError, match="no such thing"):
                await remote.boom()
            assert await remote.add(x=0) == 1  # the connection serves on after an error

        comm = await connect(ep.address)
        await comm.write({"op": "nope", "x": 1})
        answer = await comm.read()
        assert answer["status"] == "uncaught-error"
        assert "'nope'" in answer["exception_text"] and "add" in answer["exception_text"]
        await comm.write(["not", "a", "request"])
        assert "None" in (await comm.read())["exception_text"]
        await comm.write({"op": "note", "what": "a", "reply": False})  # no answer
        await comm.write({"op": "add", "x": 9})
        assert await comm.read() == 10  # the next answer is this request's
        assert h.seen == ["a"]
        await comm.write({"op": "close"})
        assert await comm.read() == "OK"
        with pytest.raises(OSError):
            await comm.read()  # it closed the connection

        # a handler whose first parameter is ``comm`` gets the connection and may keep it
        comm = await connect(ep.address)
        await comm.write({"op": "stream", "first": "hello", "reply": False})
        await comm.write("one")
        await comm.write({"two": 2})
        await comm.close()
        for _ in range(200):
            if len(h.streamed) == 3:
                break
            await asyncio.sleep(0.01)
        assert h.streamed == ["hello", "one", {"two": 2}]

        # its own requests go through Dask's connection pool
        assert await ep.rpc(ep.address).add(x=1) == 2

    asyncio.run(main())


def test_the_child_recorder_arms_one_flush_per_change_and_none_when_idle():
    armed: list = []
    sent: list = []
    ok = [True]

    def send(msg: dict) -> bool:
        if ok[0]:
            sent.append(msg)
        return ok[0]

    rec = ChildRecorder(send, lambda: (0, 0), lambda: armed.append(1))
    assert armed == []  # nothing happened: nothing to flush, no timer

    start = rec.begin("C.m", "c1")
    rec.end("C.m", "c1", start, True)
    start = rec.begin("C.m", "c2")
    assert len(armed) == 1  # three changes, one flush armed
    rec.flush()
    assert len(sent) == 1 and len(sent[0]["records"]) == 1
    assert sent[0]["running"] == {"C.m": 1}
    rec.flush()  # nothing changed since: nothing sent, nothing armed
    assert len(sent) == 1 and len(armed) == 1

    rec.end("C.m", "c2", start, False)  # a change after a flush arms the next one
    assert len(armed) == 2
    ok[0] = False  # no channel to the agent yet: it tries again later
    rec.flush()
    assert len(armed) == 3 and rec.records
    ok[0] = True
    rec.flush()
    assert len(sent) == 2 and sent[1]["running"] == {} and not rec.records
    assert len(armed) == 3
