"""``python -m benchmarks.nested_calls [N] [RUNS]``: Python calls per child of a nested burst.

A task submits N children (default 2000) and gathers them with one ``yr.get`` (as
``nested_cpu burst``), on the embedded 2-worker cluster.  A ``sys.setprofile`` counter in
the parent's worker process counts Python calls and C calls: on the parent task's thread and
the worker's loop thread (per child), and on the task threads that ran children there (per
child run there; each child installs the counter on its thread).  Deterministic where CPU
figures are noise: run it with ``PYTHONPATH`` set to another tree to compare (it uses only
``yr.invoke``, ``yr.get`` and the runtime's loop, so older trees run it too, by path).
"""
from __future__ import annotations

import sys
from typing import Any

import yrdask as yr


@yr.invoke
def inc(i: int) -> int:
    prof = getattr(sys, "_nest_prof", None)
    if prof is not None and sys.getprofile() is not prof:
        sys.setprofile(prof)
    return i + 1


@yr.invoke
def burst(n: int, top: int) -> tuple[dict, int]:
    import collections
    import threading

    from yrdask.runtime.context import current_runtime
    rt = current_runtime()
    counts = {"parent": collections.Counter(), "loop": collections.Counter(),
              "task": collections.Counter()}
    me = threading.get_ident()
    ids = {}
    state = {"on": True, "local": 0}

    def prof(frame: Any, event: str, arg: Any) -> None:
        if not state["on"]:
            return
        if event == "call":
            c = frame.f_code
            key = (c.co_filename.rsplit("/", 3)[-1], c.co_firstlineno, c.co_name)
            if c.co_name == "inc":
                state["local"] += 1
        elif event == "c_call":
            key = ("C", 0, getattr(arg, "__qualname__", repr(arg)))
        else:
            return
        t = threading.get_ident()
        counts["parent" if t == me else "loop" if t == ids.get("loop") else "task"][key] += 1

    on = threading.Event()

    def install() -> None:
        ids["loop"] = threading.get_ident()
        sys.setprofile(prof)
        on.set()

    rt.loop.call_soon_threadsafe(install)
    on.wait()
    sys._nest_prof = prof
    sys.setprofile(prof)
    yr.get([inc.invoke(i) for i in range(n)])
    sys.setprofile(None)
    state["on"] = False
    sys._nest_prof = None
    off = threading.Event()
    rt.loop.call_soon_threadsafe(lambda: (sys.setprofile(None), off.set()))
    off.wait()
    out = {}
    for kind, c in counts.items():
        py = sum(v for k, v in c.items() if k[0] != "C")
        cc = sum(v for k, v in c.items() if k[0] == "C")
        out[kind] = (py, cc, [(k, v) for k, v in c.most_common(top)])
    return out, state["local"]


def main(n: int, runs: int) -> None:
    yr.init()
    try:
        yr.get(burst.invoke(300, 0))  # warm: functions sent, leases held, threads up
        for _ in range(runs):
            out, local = yr.get(burst.invoke(n, 45))
            line = [f"children {n}, ran here {local}:"]
            for kind, (py, cc, _top) in out.items():
                per = n if kind != "task" else max(local, 1)
                line.append(f"{kind} py {py / per:.1f} C {cc / per:.1f}")
            print("  ".join(line) + "  (parent/loop per child, task per local child)")
        for kind, (py, cc, top) in out.items():
            per = n if kind != "task" else max(local, 1)
            print(f"--- {kind}")
            for k, v in top:
                print(f"{v / per:8.2f}  {k}")
    finally:
        yr.finalize()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000,
         int(sys.argv[2]) if len(sys.argv) > 2 else 2)
