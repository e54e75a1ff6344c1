"""Fan-out / fan-in: estimate pi with 16 Monte Carlo tasks, then sum their counts.

Run: ``python examples/fan_out_fan_in.py`` (starts an embedded cluster on this machine).
"""

import random

import yrdask as yr

TASKS = 16
SAMPLES = 200_000


@yr.invoke
def count_inside(seed: int, samples: int) -> int:
    """Points of the unit square that fall inside the quarter circle."""
    rng = random.Random(seed)
    inside = 0
    for _ in range(samples):
        x, y = rng.random(), rng.random()
        if x * x + y * y <= 1.0:
            inside += 1
    return inside


yr.init()
refs = [count_inside.invoke(seed, SAMPLES) for seed in range(TASKS)]  # fan out
inside = sum(yr.get(refs))                                            # fan in
pi = 4.0 * inside / (TASKS * SAMPLES)
print(f"pi ~= {pi:.4f} from {TASKS} tasks x {SAMPLES} samples")
yr.finalize()
