"""Back-pressure with ``yr.wait``: at most 20 tasks in flight, 100 results in all.

Run: ``python examples/wait_backpressure.py``.
"""

import time

import yrdask as yr

TOTAL = 100
MAX_IN_FLIGHT = 20


@yr.invoke
def square(i: int) -> int:
    time.sleep(0.01)  # stands in for real work
    return i * i


yr.init()
pending, results, peak = [], [], 0
for i in range(TOTAL):
    if len(pending) >= MAX_IN_FLIGHT:
        ready, pending = yr.wait(pending, wait_num=1, timeout=10)
        results += yr.get(ready)
    pending.append(square.invoke(i))
    peak = max(peak, len(pending))
results += yr.get(pending)

print(f"{len(results)} results, at most {peak} tasks in flight, "
      f"sum of squares = {sum(results)}")
assert len(results) == TOTAL and sum(results) == sum(i * i for i in range(TOTAL))
yr.finalize()
