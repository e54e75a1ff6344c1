"""A Ray program with progress bars in a task, an actor and the driver (test_ray_tqdm.py)."""

import os
import time

import ray
from ray.experimental.tqdm_ray import instance, tqdm

ray.init(num_cpus=2)


@ray.remote
def count(n):
    bar = tqdm(total=n, desc="task-bar", flush_interval_s=0)
    for _ in range(n):
        bar.update(1)
    bar.close()
    return os.getpid()


@ray.remote
class Walker:
    def walk(self, n):
        for _ in tqdm(range(n), desc="actor-bar", flush_interval_s=0):
            pass
        bar = tqdm(desc="actor-closed", total=1, flush_interval_s=0)
        bar.update(1)
        bar.close()
        return os.getpid()


task_pid = ray.get(count.remote(3))
actor_pid = ray.get(Walker.remote().walk.remote(2))
for _ in tqdm(range(2), desc="driver-bar", flush_interval_s=0):
    pass
deadline = time.monotonic() + 60
while instance().closed < 2 and time.monotonic() < deadline:  # both closes reached us
    time.sleep(0.05)
print(f"pids {task_pid} {actor_pid}", flush=True)
