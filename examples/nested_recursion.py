"""Nested recursion: a divide-and-conquer sum where each task invokes two sub-tasks.

A task that blocks in ``yr.get`` gives its CPU slot back while it waits, so this tree of
nested tasks (far more tasks than the 2 CPUs) runs without deadlock.

Run: ``python examples/nested_recursion.py`` -> ``sum(range(100)) = 4950``.
"""

import yrdask as yr

LEAF = 10  # ranges this short are summed directly


@yr.invoke
def range_sum(lo: int, hi: int) -> int:
    if hi - lo <= LEAF:
        return sum(range(lo, hi))
    mid = (lo + hi) // 2
    left, right = range_sum.invoke(lo, mid), range_sum.invoke(mid, hi)
    return sum(yr.get([left, right]))


yr.init(yr.Config(num_cpus=2))
total = yr.get(range_sum.invoke(0, 100))
print(f"sum(range(100)) = {total}")
assert total == 4950, total
yr.finalize()
