"""A Ray program that ends with work in flight; on Ray it ends quietly with exit code 0.

``asyncio.run`` gives up on awaited refs (a time-out, then the loop closes), a task is
cancelled with ``force=True`` (its worker process ends), and ``ray.shutdown()`` runs while
tasks still sleep in the workers.
"""

import asyncio
import time

import ray


@ray.remote
def sleepy(seconds):
    time.sleep(seconds)
    return seconds


async def main():
    first = [asyncio.ensure_future(sleepy.remote(s)) for s in (0.0, 1.5, 1.5)]
    done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    print("first", [d.result() for d in done])
    try:
        await asyncio.wait_for(sleepy.remote(1.5), 0.1)
    except asyncio.TimeoutError:
        print("timed out")


ray.init(num_cpus=2)
asyncio.run(main())
forced = sleepy.remote(600)
ray.wait([forced], timeout=0.5)
ray.cancel(forced, force=True)  # its worker process ends: not reported as a death
in_flight = [sleepy.remote(1.0) for _ in range(4)]
ray.wait(in_flight, timeout=0.5)
ray.shutdown()
print("shut down")
