"""Task programs for the simulation: small random trees, and the result each must give.

A *program* is what a simulated task does once a worker starts it: a leaf computes a value
for some virtual time (and may raise a retryable user error its first few attempts); a
fan-out computes a little, submits its children from inside the worker, blocks in a ``get``
on them (lending its lease's CPU and its gate slot), then computes a little more and returns
its own value plus the children's.  A generator leaf (``items``) yields its items one by one
while it computes (an attempt that raises does so halfway); whoever submitted it consumes
them, and its result in the tree is the sum of the items consumed.  Expected outcomes follow
from the tree alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

DEFAULT_SHAPE = (("CPU", 500.0), ("Memory", 500.0))
BIG_SHAPE = (("CPU", 1000.0), ("Memory", 500.0))
NEVER_SHAPE = (("CPU", 64000.0), ("Memory", 500.0))  # larger than any simulated worker


class UserBoom(Exception):
    """The user error a leaf raises on its first ``fail_first`` attempts."""


@dataclass(slots=True, eq=False)
class Program:
    """One node of a task tree (see module docstring)."""

    path: str  # "3", "3.0", "3.0.1": the tree and the node, for stories
    value: int
    compute: float  # virtual seconds before submitting children / returning
    compute_after: float = 0.0  # fan-outs: virtual seconds after the children are done
    children: list["Program"] = field(default_factory=list)
    fail_first: int = 0  # leaves: attempts that raise UserBoom (retryable)
    retries: int = 0  # the task's retry_times
    shape: tuple = DEFAULT_SHAPE
    slots: int = 1  # the shape's concurrency
    timeout_ms: int = 30000
    max_crashes: int | None = None  # reruns after lost workers (None: the queue's bound)
    group: str | None = None  # leaves: runs in this resource group's bundle (scenario.py)
    bundle: int = -1  # the bundle index (-1: any bundle of the group)
    items: int | None = None  # leaves: a generator yielding this many items (None: a value)
    drop_after: int | None = None  # generators: the consumer drops the generator after so many
    # ref arguments (scenario.REF_SEEDS): the task's argument holds (nested in a list) the
    # ref of an earlier task of the same submitter (a driver's top-level task, or a sibling),
    # the one at ``ref_arg`` (0..1) of those submitted so far; the task keeps that ref on its
    # worker ``keep_ref`` virtual seconds after it ends, and/or returns it in its result;
    # the driver may drop its own ref once passed, leaving the argument the only holder
    ref_arg: float | None = None
    keep_ref: float = 0.0
    return_ref: bool = False
    drop_passed: bool = False  # the driver drops that ref once it passed it (f.remote([r]))

    @property
    def generator(self) -> bool:
        return self.items is not None

    def item_value(self, index: int) -> int:
        """What a generator yields at ``index`` (the same in every attempt)."""
        return self.value * 10 + index

    @property
    def leaf(self) -> bool:
        return not self.children

    def size(self) -> int:
        return 1 + sum(c.size() for c in self.children)

    def expected(self) -> tuple[str, object]:
        """``("ok", value)``, ``("error", "user")`` or ``("error", "schedule")``."""
        if self.shape == NEVER_SHAPE:
            return ("error", "schedule")
        if self.leaf:
            if self.fail_first > self.retries:
                return ("error", "user")
            if self.generator:  # what its consumer sums up
                return ("ok", sum(self.item_value(i) for i in range(self.items)))
            return ("ok", self.value)
        total = self.value
        for child in self.children:  # the get raises the first failed child's error
            kind, value = child.expected()
            if kind == "error":
                return (kind, value)
            total += value
        return ("ok", total)


def _duration(rng: random.Random, slow: float) -> float:
    """Mostly short (pipelined) runs, sometimes long ones."""
    r = rng.random()
    if r < slow:
        return rng.uniform(0.2, 3.0)
    if r < 0.7:
        return rng.uniform(0.0002, 0.004)
    return rng.uniform(0.005, 0.08)


def make_tree(rng: random.Random, path: str, budget: int, depth: int, slow: float,
              odd: float) -> Program:
    """A random program of at most ``budget`` nodes (fan-outs while depth and budget allow)."""
    value = rng.randrange(1000)
    shape, slots = DEFAULT_SHAPE, 1
    r = rng.random()
    if r < 0.12:
        shape = BIG_SHAPE
    elif r < 0.17:
        shape, slots = BIG_SHAPE, 2
    if budget >= 3 and depth < 3 and rng.random() < 0.45:
        prog = Program(path, value, _duration(rng, slow) / 4, _duration(rng, slow) / 4,
                       shape=shape, slots=slots)
        left = budget - 1
        n = rng.randint(1, min(4, left))
        for i in range(n):
            share = max(1, left // (n - i)) if i < n - 1 else left
            share = rng.randint(1, share)
            left -= share
            prog.children.append(make_tree(rng, f"{path}.{i}", share, depth + 1, slow, odd))
        return prog
    prog = Program(path, value, _duration(rng, slow), shape=shape, slots=slots)
    if rng.random() < odd:
        prog.retries = rng.randint(0, 2)
        prog.fail_first = rng.randint(1, 3)
    if value % 8 == 0:  # (from a value drawn already: the seeds' other draws stay put)
        prog.max_crashes = (0, 1, -1, None)[value // 8 % 4]
    if rng.random() < odd / 4:
        prog.shape = NEVER_SHAPE
        prog.timeout_ms = rng.choice([0, 100, 30000])
    return prog
