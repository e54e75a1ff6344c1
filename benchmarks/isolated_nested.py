"""``python -m benchmarks.isolated_nested [N]``: what a nested call costs in an isolated process.

N ``num_gpus=1, max_calls=1`` tasks (a fresh isolated process each; one declared GPU, no
hardware needed) each time their first nested ``ray.get(inc.remote(1))``, which starts the
process's runtime (docs/isolation.md#nested-calls), the runtime start alone, and a second
nested call; then ten such tasks that make no nested call.  Medians, with min and max.
"""

from __future__ import annotations

import statistics
import sys
import time

import yrdask.ray as ray


@ray.remote
def inc(x):
    return x + 1


@ray.remote(num_gpus=1, max_calls=1)  # a fresh process per task: each pays the start
def probe():
    from yrdask.runtime.context import installed_runtime

    t0 = time.perf_counter()
    ray.get(inc.remote(1))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.get(inc.remote(1))
    second = time.perf_counter() - t0
    return first, second, installed_runtime().start_s


@ray.remote(num_gpus=1, max_calls=1)
def plain():
    return 1


def ms(xs: list) -> str:
    return (f"median {statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f}, "
            f"max {max(xs) * 1e3:.1f})")


def main(n: int) -> None:
    ray.init(num_cpus=2, num_gpus=1)
    try:
        ray.get(plain.remote())  # the worker's zygote starts
        runs = [ray.get(probe.remote()) for _ in range(n)]
        print("first nested call (start + round trip):", ms([r[0] for r in runs]))
        print("  of which the runtime's start:        ", ms([r[2] for r in runs]))
        print("second nested call (round trip):       ", ms([r[1] for r in runs]))
        plain_s = []
        for _ in range(10):
            t0 = time.perf_counter()
            ray.get(plain.remote())
            plain_s.append(time.perf_counter() - t0)
        print("a task with no nested call, in a fresh process:", ms(plain_s))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
