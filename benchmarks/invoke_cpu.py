"""``python -m benchmarks.invoke_cpu [N]``: the calling thread's steps per ``f.invoke(i)``.

What a driver's user thread spends per submitted task before the loop takes over: the
signature check, argument pickling, the ref and its entry, the ``Task`` record.  The loop's
part is cut off (``Runtime.on_loop`` drops the task), so nothing contends for the GIL and the
figure does not move with the machine's load the way ``scale_cpu``'s ``MainThread`` does.
Best of 7 bursts of N (default 20 000) on the embedded 2-CPU cluster, collector off; µs of
the thread's CPU per invoke (its CPU clock: time the thread waited for a core is not counted).  Prints one JSON line (docs/changelog/performance-history.md,
"2026-11-27: The driver's CPU per task, and what a message costs").
"""

from __future__ import annotations

import gc
import json
import sys
import time

import yrdask as yr
from yrdask.runtime import context


@yr.invoke
def empty(i):
    return i


def main(n: int = 20000) -> dict:
    yr.init(yr.Config(num_cpus=2))
    try:
        yr.get([empty.invoke(i) for i in range(200)])  # the function is sent, leases warm
        rt = context.current_runtime()
        rt.on_loop = lambda fn, *args: None  # the submitter never sees these tasks
        gc.disable()
        best = float("inf")
        try:
            for _ in range(7):
                t = time.thread_time()
                refs = [empty.invoke(i) for i in range(n)]
                best = min(best, time.thread_time() - t)
                del refs
        finally:
            gc.enable()
            del rt.on_loop
    finally:
        yr.finalize()
    return {"invokes": n, "us_per_invoke": round(best / n * 1e6, 3)}


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:2]))))
