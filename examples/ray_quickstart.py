"""A Ray Core program on yrdask: tasks, an actor, an ActorPool and Ray's error types.

Run it unchanged with ``python -m yrdask.ray examples/ray_quickstart.py`` (the script says
``import ray``; nothing named ``ray`` is installed, yrdask.ray stands in for it).
"""

import ray
from ray.util import ActorPool

ray.init(num_cpus=2)


@ray.remote
def square(x: int) -> int:
    return x * x


@ray.remote
class Accumulator:
    def __init__(self) -> None:
        self.total = 0

    def add(self, value: int) -> int:
        self.total += value
        return self.total


@ray.remote
def divide(a: int, b: int) -> float:
    return a / b


squares = ray.get([square.remote(i) for i in range(10)])
acc = Accumulator.remote()
for s in squares:
    acc.add.remote(s)
print("sum of squares:", ray.get(acc.add.remote(0)))

pool = ActorPool([Accumulator.remote(), Accumulator.remote()])
print("pool:", list(pool.map(lambda a, v: a.add.remote(v), [1, 2, 3, 4])))

try:
    ray.get(divide.remote(1, 0))
except ZeroDivisionError as e:  # also a ray.exceptions.RayTaskError, as on Ray
    print("caught:", type(e).__name__)

ray.shutdown()
