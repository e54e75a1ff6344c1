"""A Ray program run unchanged with ``python -m yrdask.ray ray_program.py MARKER_DIR``.

It prints one line per check; tests/ray_surface/test_ray_script.py compares them with what Ray prints.
"""

import asyncio
import os
import sys

import ray
from ray.util import ActorPool

from ray_helpers import Doubler, doubled_via_object_store

marker_dir = sys.argv[1]
ray.init(num_cpus=2)


@ray.remote(max_retries=2)
def crash_first_time(path):
    """Kills its worker process the first time it runs: the task is retried elsewhere."""
    if not os.path.exists(path):
        open(path, "w").close()
        os._exit(1)
    return "recovered after a worker crash"


print(ray.get(crash_first_time.remote(os.path.join(marker_dir, "crashed"))))


@ray.remote(max_retries=0)
def crash_always(path):
    """Not idempotent: with max_retries=0 it must run once, then fail."""
    with open(path, "a") as f:
        f.write("x")
    os._exit(1)


runs = os.path.join(marker_dir, "runs")
try:
    ray.get(crash_always.remote(runs))
except ray.exceptions.WorkerCrashedError:
    print("WorkerCrashedError after", len(open(runs).read()), "run(s)")


@ray.remote(max_retries=3, retry_exceptions=True)
def flaky(path):
    tries = len(open(path).read()) if os.path.exists(path) else 0
    with open(path, "a") as f:
        f.write("x")
    if tries < 2:
        raise ConnectionError(f"try {tries}")
    return f"succeeded on try {tries}"


print(ray.get(flaky.remote(os.path.join(marker_dir, "flaky"))))


@ray.remote
def uses_helper(x):
    return doubled_via_object_store(x)


print("helper:", ray.get(uses_helper.remote(21)))
doubler = ray.remote(Doubler).remote()
print("helper actor:", ray.get(doubler.double.remote(42)))


@ray.remote
def fails():
    raise KeyError("missing")


try:
    ray.get(fails.remote())
except KeyError as e:
    print("KeyError caught; is RayTaskError:", isinstance(e, ray.exceptions.RayTaskError))


@ray.remote
class Worker:
    def work(self, x):
        return x + 100


pool = ActorPool([Worker.remote(), Worker.remote()])
print("pool:", list(pool.map(lambda a, v: a.work.remote(v), [1, 2, 3, 4])))


@ray.remote
class Pinger:
    def __init__(self):
        self.pongs = 0

    async def ping(self):
        await asyncio.sleep(0)
        self.pongs += 1
        return self.pongs


p = Pinger.remote()
print("async:", sorted(ray.get([p.ping.remote() for _ in range(5)])))


async def main():
    return await p.ping.remote()


print("await:", asyncio.run(main()))
ray.shutdown()
print("done")
