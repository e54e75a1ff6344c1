"""``python -m benchmarks.loop_calls [N]``: Python calls on the driver's loop thread per
sequential instance method call.

N (default 5 000) calls of ``get(h.inc.invoke(1))`` on one instance (the default kind) of
the embedded 2-CPU cluster, after 200 warm-up calls, with a profile function on the loop thread that counts
every Python function call it runs meanwhile.  Prints one JSON line: calls per instance call
in all, in yrdask's own modules, and in the instance router and its machine
(``runtime/instance_router.py``, ``call_router.py``, ``call_order.py``).  The counts do not
move with the machine's load the way times do, so a change of the call path shows as a
change of these counts (docs/performance.md, "Current figures").
"""

from __future__ import annotations

import json
import sys
import threading

import yrdask as yr
from benchmarks import workloads
from yrdask.runtime.context import current_runtime

ROUTER = ("runtime/instance_router.py", "runtime/call_router.py", "runtime/call_order.py")


def main(n: int = 5000) -> dict:
    yr.init(yr.Config(num_cpus=2))
    try:
        h = yr.instance(workloads.Counter).invoke()
        for _ in range(200):
            yr.get(h.inc.invoke(1))
        loop = current_runtime().loop
        counts = {"all": 0, "yrdask": 0, "router": 0}
        done = threading.Event()

        def count(frame, event, _arg):
            if event == "call":
                counts["all"] += 1
                path = frame.f_code.co_filename
                if "/yrdask/" in path:
                    counts["yrdask"] += 1
                    if path.endswith(ROUTER):
                        counts["router"] += 1

        def stop() -> None:
            sys.setprofile(None)
            done.set()

        loop.call_soon_threadsafe(sys.setprofile, count)
        for _ in range(n):
            yr.get(h.inc.invoke(1))
        loop.call_soon_threadsafe(stop)
        assert done.wait(30), "the loop thread never ran the stop"
        return {"calls": n, **{k: round(v / n, 2) for k, v in counts.items()}}
    finally:
        yr.finalize()


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:]))))
