"""Seeded random task trees on real clusters, with exact expected results.

Each seed builds a tree of nested work: outer tasks wider than the cluster's slots, each
submitting children and blocking in ``yr.get`` (depth up to 3), instances created inside
tasks and called there, refs passed on as arguments (top level, resolved; and inside a list,
read with ``yr.get``), and a plain method that returns a ref of a task it submitted.  The
expected result is computed locally from the same tree.  Runs on the embedded cluster
(``num_cpus=2``) and on a ``dask scheduler/worker --preload yrdask`` CLI cluster.

Also here: cancels at random moments must never hit another task or leak a lease slot.
"""

from __future__ import annotations

import random
import time

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(120)

T = 60  # seconds: explicit yr.get bound, under the test time-out

SMALL = yr.InvokeOptions(cpu=100, memory=0)  # instances made inside tasks: little CPU each


# -- the remote side -------------------------------------------------------------------------


@yr.invoke
def leaf(v):
    return 2 * v + 1


@yr.invoke
def combine(*values):
    """Refs passed as top-level arguments arrive as their values."""
    return sum(values) + 1


@yr.invoke
def combine_nested(box):
    """Refs inside a list arrive as refs (borrowed): read them here."""
    return sum(yr.get(box[0], T)) + 2


@yr.instance
class Acc:
    def __init__(self, base):
        self.total = base

    def add(self, x):
        self.total += x
        return self.total

    def get(self):
        return self.total


@yr.instance
class Spawner:
    def spawn(self, v):
        """A plain method returning a ref: the caller receives the ref itself."""
        return leaf.invoke(v)


def _submit(spec):
    return leaf.invoke(spec) if isinstance(spec, int) else node.invoke(spec)


@yr.invoke
def node(spec):
    kind, children = spec
    refs = [_submit(c) for c in children]
    if kind == "sum":
        return sum(yr.get(refs, T))
    if kind == "pass":
        return yr.get(combine.invoke(*refs), T)
    if kind == "nested":
        return yr.get(combine_nested.invoke([refs]), T)
    values = yr.get(refs, T)
    if kind == "inst":
        acc = Acc.options(SMALL).invoke(len(values))
        try:
            for v in values:
                acc.add.invoke(v)
            return yr.get(acc.get.invoke(), T)
        finally:
            acc.terminate()
    if kind == "spawn":
        spawner = Spawner.options(SMALL).invoke()
        try:
            inner = yr.get(spawner.spawn.invoke(sum(values)), T)
            assert isinstance(inner, yr.ObjectRef), f"spawn returned {type(inner)}"
            return yr.get(inner, T)
        finally:
            spawner.terminate()
    raise ValueError(kind)


# -- the local model -------------------------------------------------------------------------

KINDS = ("sum", "pass", "nested", "inst", "spawn")


def expected(spec) -> int:
    if isinstance(spec, int):
        return 2 * spec + 1
    kind, children = spec
    values = [expected(c) for c in children]
    if kind == "sum":
        return sum(values)
    if kind == "pass":
        return sum(values) + 1
    if kind == "nested":
        return sum(values) + 2
    if kind == "inst":
        return len(values) + sum(values)
    if kind == "spawn":
        return 2 * sum(values) + 1
    raise ValueError(kind)


def random_tree(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.25:
        return rng.randint(0, 1000)
    children = [random_tree(rng, depth - 1) for _ in range(rng.randint(1, 4))]
    return (rng.choice(KINDS), children)


def random_forest(seed: int) -> list:
    """More outer tasks than a 2-CPU cluster has slots (4), each a subtree of depth 1-3."""
    rng = random.Random(seed)
    outer = []
    for _ in range(rng.randint(5, 9)):
        tree = random_tree(rng, rng.randint(1, 3))
        outer.append(tree if isinstance(tree, tuple) else ("sum", [tree]))
    return outer


def run_forest(seed: int) -> None:
    forest = random_forest(seed)
    got = yr.get([node.invoke(tree) for tree in forest], T)
    assert got == [expected(tree) for tree in forest], f"seed {seed}: {forest}"


def test_the_model_covers_every_kind():
    kinds = set()

    def walk(spec):
        if isinstance(spec, tuple):
            kinds.add(spec[0])
            for c in spec[1]:
                walk(c)

    for seed in range(6):
        for tree in random_forest(seed):
            walk(tree)
    assert kinds == set(KINDS)


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_embedded(cluster, seed):
    cluster(kind="embedded", num_cpus=2)
    run_forest(seed)


@pytest.mark.parametrize("seed", range(100, 103))
def test_random_trees_cli(cli_cluster, seed):
    run_forest(seed)


def test_sync_method_returning_a_ref(yr_cluster):
    spawner = Spawner.options(SMALL).invoke()
    try:
        inner = yr.get(spawner.spawn.invoke(20), T)
        assert isinstance(inner, yr.ObjectRef)
        assert yr.get(inner, T) == 41
    finally:
        spawner.terminate()


# -- cancels at random moments ---------------------------------------------------------------


@yr.invoke
def busy(i, n):
    total = 0
    for k in range(n):
        total += k
    return i


@pytest.mark.parametrize("seed", [7, 8])
def test_random_cancels_hit_only_their_task_and_leak_no_slot(cluster, seed):
    """Cancel short tasks around the moment they run or end (when the task 4 places ahead
    is done, this one most likely runs): a cancel must fail only its own task, and every
    task after it must still get a slot."""
    cluster(kind="embedded", num_cpus=2)
    rng = random.Random(seed)
    n = 300
    refs = [busy.invoke(i, rng.choice([0, 2_000, 10_000, 40_000])) for i in range(n)]
    cancelled = set()
    for i in range(n):
        if i >= 4:
            deadline = time.monotonic() + T
            while not refs[i - 4].done() and time.monotonic() < deadline:
                pass
        if rng.random() < 0.5:
            for _ in range(rng.randrange(2000)):  # a random moment, finer than sleep()
                pass
            yr.cancel(refs[i])
            cancelled.add(i)
    for i, ref in enumerate(refs):
        try:
            assert yr.get(ref, T) == i, f"task {i} returned another task's value"
        except yr.CancelledError:
            assert i in cancelled, f"task {i} was never cancelled but raised CancelledError"
    # Later tasks on the same workers: every one completes (a leaked slot would hold them).
    later = [busy.invoke(i, 1000) for i in range(60)]
    assert yr.get(later, T) == list(range(60))
    wide = [busy.invoke(i, 300_000) for i in range(8)]  # more than the 4 slots at once
    assert yr.get(wide, T) == list(range(8))
