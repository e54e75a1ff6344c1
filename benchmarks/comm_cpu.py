"""``python -m benchmarks.comm_cpu [BATCHES]``: CPU of Dask's TCP comm per write and read, by
batch size, both ends in one process (no other work).

A driver loop pays this for every ``RUN_TASK`` write and ``TASK_DONE`` read on its call
channels; how many messages each carries (``benchmarks/scale_cpu.py``, ``messages``) decides
what a task pays: with ``k`` messages per write and per read, a task costs ``fixed / k +
per_message`` of comm CPU.  With a core per worker the batches are short (each worker answers
each task at once), which is why the driver's loop spends more per task on 16 cores than on 2
(docs/changelog/performance-history.md,
"2026-11-27: The driver's CPU per task, and what a message costs").  Each batch is written with ``StreamSender``'s comm
write and read back by the reader, one batch in flight at a time (as on a channel whose peer
answers each push); the messages are a ``RUN_TASK`` wire dict and a ``TASK_DONE`` one in turn.
Reports µs of process CPU per batch (write, loop wake-up, read, hand-over) for k = 1, 2, 4,
8, of it the write alone (``comm.write`` completes inline), the fit ``fixed + k *
per_message``, and the process's selector registrations per batch.  Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import selectors
import sys
import time

from distributed.comm import connect, listen

from yrdask import protocol as P

_ops = [0]


def _count_selector_ops() -> None:
    sel = selectors.DefaultSelector
    for name in ("register", "unregister", "modify"):
        def counted(self, *args, _op=getattr(sel, name), **kwargs):
            _ops[0] += 1
            return _op(self, *args, **kwargs)

        setattr(sel, name, counted)


def _messages() -> list[dict]:
    push = P.RunTask.wire("1a2b3c4d5e6f-1f3", "l12", "empty-3f2a9c0d1e2b3c4d", None,
                          pickle.dumps(((7,), {})), [], 1, "job-8a7b6c5d", "empty", 2, None)
    answer = P.TaskDone.wire("1a2b3c4d5e6f-1f3", results=[[P.VALUE, pickle.dumps(7)]],
                             took=1.2e-5)
    return [push, answer]


async def _run(batches: int) -> dict:
    got: asyncio.Queue = asyncio.Queue()

    async def serve(comm) -> None:
        try:
            while True:
                got.put_nowait(await comm.read())
        except Exception:
            pass

    server = await listen("tcp://127.0.0.1:0", serve)
    await server.start()
    comm = await connect(server.contact_address)
    comm.allow_offload = False  # as StreamSender sets it
    kinds = _messages()
    out: dict = {}
    for k in (1, 2, 4, 8):
        batch = [kinds[i % 2] for i in range(k)]
        for _ in range(200):  # warm
            await comm.write(batch, on_error="raise")
            await got.get()
        ops0 = _ops[0]
        writing = 0.0
        clock = time.perf_counter
        cpu0 = time.process_time()
        for _ in range(batches):
            t = clock()
            await comm.write(batch, on_error="raise")  # done inline: no wait in it
            writing += clock() - t
            await got.get()
        cpu = time.process_time() - cpu0
        out[k] = (cpu / batches * 1e6, (_ops[0] - ops0) / batches, writing / batches * 1e6)
    await comm.close()
    server.stop()
    return out


def main(batches: int = 20000) -> dict:
    _count_selector_ops()
    runs = [asyncio.run(_run(batches)) for _ in range(3)]
    per_batch = {k: min(r[k][0] for r in runs) for k in runs[0]}  # best of 3
    per_message = (per_batch[8] - per_batch[1]) / 7
    return {
        "batches": batches,
        "us_per_batch": {k: round(v, 2) for k, v in per_batch.items()},
        "write_us_per_batch": {k: round(min(r[k][2] for r in runs), 2) for k in runs[0]},
        "fixed_us_per_write_and_read": round(per_batch[1] - per_message, 2),
        "us_per_message": round(per_message, 2),
        "selector_ops_per_batch": runs[0][1][1],
    }


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:2]))))
