"""Streaming generators (yr_api §1.10, docs/generators.md) on embedded and cli clusters:
``.invoke()`` of a generator function or method returns an ``ObjectRefGenerator``."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import yrdask as yr
from conftest import wait_for_file

pytestmark = pytest.mark.timeout(240)

T = 60  # seconds: explicit bound of every yr.get / next, well under the test time-out


@yr.invoke
def count_up(n):
    for i in range(n):
        yield i * 10


@yr.invoke
def fails_at(k):
    for i in range(k):
        yield i
    raise ValueError(f"no item {k}")


@yr.invoke
def big_items(n, size):
    for i in range(n):
        yield bytes([i]) * size


@yr.invoke
def sum_of_stream(n):
    """Inside a task: consume a generator this task owns."""
    return sum(yr.get(list(count_up.invoke(n)), timeout=T))


@yr.invoke
def dies_once_after(k, total, go_path, died_path):
    """Yields ``k`` items, waits for ``go_path``, then its process is killed (SIGKILL, as the
    OOM killer or an eviction would: a loss from outside, not spending retry_times) the
    first time."""
    for i in range(total):
        if i == k and not os.path.exists(died_path):
            wait_for_file(go_path)
            open(died_path, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        yield i


@yr.invoke
def blocks_after_first(path):
    yield "first"
    wait_for_file(path, timeout=120)
    yield "never"


@yr.instance
class Tally:
    def __init__(self) -> None:
        self.n = 0

    def steps(self, k):
        for _ in range(k):
            self.n += 1
            yield self.n

    def total(self):
        return self.n

    def dies_after(self, k, go_path):
        for i in range(k):
            yield i
        wait_for_file(go_path)
        os._exit(3)


@yr.instance
class Ticker:
    async def ticks(self, n):
        for i in range(n):
            await asyncio.sleep(0)
            yield f"tick {i}"

    async def ping(self):
        return "pong"

    async def sum_stream(self, n):
        """Inside an async method: a generator task consumed with async for + await."""
        total = 0
        async for ref in count_up.invoke(n):
            total += await ref
        return total


def test_generator_function_streams_its_items_in_order(yr_cluster):
    gen = count_up.invoke(4)
    assert isinstance(gen, yr.ObjectRefGenerator)
    refs = list(gen)
    assert all(isinstance(r, yr.ObjectRef) for r in refs)
    assert yr.get(refs, timeout=T) == [0, 10, 20, 30]
    assert gen.is_finished()
    assert yr.get(gen.completed(), timeout=T) == 4  # the call's own ref: the item count
    assert list(gen) == []  # stays finished


def test_next_then_loop_resumes_where_it_left_off(yr_cluster):
    gen = count_up.invoke(5)
    first = next(gen)
    assert yr.get(first, timeout=T) == 0
    assert yr.get(gen.next(timeout=T), timeout=T) == 10
    assert [yr.get(r, timeout=T) for r in gen] == [20, 30, 40]
    with pytest.raises(StopIteration):
        next(gen)


def test_generator_method_keeps_instance_state(yr_cluster):
    h = Tally.invoke()
    gen = h.steps.invoke(3)
    assert isinstance(gen, yr.ObjectRefGenerator)
    assert yr.get(list(gen), timeout=T) == [1, 2, 3]
    assert yr.get(list(h.steps.invoke(2)), timeout=T) == [4, 5]
    assert yr.get(h.total.invoke(), timeout=T) == 5
    h.terminate()


def test_async_generator_method_with_async_for_and_await(yr_cluster):
    h = Ticker.invoke()

    async def consume():
        out = []
        async for ref in h.ticks.invoke(3):
            out.append(await ref)
        return out

    assert asyncio.run(asyncio.wait_for(consume(), T)) == ["tick 0", "tick 1", "tick 2"]
    assert yr.get(h.ping.invoke(), timeout=T) == "pong"  # the instance still serves calls
    h.terminate()


def test_exception_at_item_k_fails_the_kth_ref_then_ends(yr_cluster):
    gen = fails_at.invoke(2)
    assert yr.get([next(gen), next(gen)], timeout=T) == [0, 1]
    bad = next(gen)
    with pytest.raises(ValueError, match="no item 2") as err:
        yr.get(bad, timeout=T)
    assert isinstance(err.value, yr.YRInvokeError) and isinstance(err.value, RuntimeError)
    with pytest.raises(StopIteration):
        next(gen)
    assert gen.is_finished()


def test_a_thousand_small_items_arrive_in_order(yr_cluster):
    refs = list(count_up.invoke(1000))
    assert len(refs) == 1000
    assert yr.get(refs, timeout=T) == [i * 10 for i in range(1000)]
    assert len({r.id for r in refs}) == 1000


def test_large_items_are_kept_on_the_worker_and_fetched(yr_cluster):
    size = 1024 * 1024  # above the inline limit: each item stays on the worker
    values = yr.get(list(big_items.invoke(3, size)), timeout=T)
    assert [bytes(v) for v in values] == [bytes([i]) * size for i in range(3)]


def test_generator_consumed_inside_a_task(yr_cluster):
    assert yr.get(sum_of_stream.invoke(50), timeout=T) == sum(i * 10 for i in range(50))


def test_generator_consumed_with_async_for_inside_an_async_method(yr_cluster):
    h = Ticker.invoke()
    assert yr.get(h.sum_stream.invoke(20), timeout=T) == sum(i * 10 for i in range(20))
    h.terminate()


def test_generator_cannot_be_passed_to_a_task(yr_cluster):
    gen = count_up.invoke(1)
    with pytest.raises(TypeError, match="Pass the ObjectRefs it yields"):
        sum_of_stream.invoke(gen)
    assert yr.get(list(gen), timeout=T) == [0]


@pytest.mark.parametrize("how", ["method", "yr.cancel"])
def test_cancel_stops_a_running_generator(yr_cluster, tmp_path, how):
    gen = blocks_after_first.invoke(str(tmp_path / "never"))
    assert yr.get(next(gen), timeout=T) == "first"
    if how == "method":
        gen.cancel()
    else:
        yr.cancel(gen)
    with pytest.raises(yr.CancelledError):
        yr.get(gen.next(timeout=T), timeout=T)
    with pytest.raises(StopIteration):
        next(gen)


def test_worker_death_mid_stream_reruns_without_duplicate_items(yr_cluster, tmp_path):
    go, died = str(tmp_path / "go"), str(tmp_path / "died")
    gen = dies_once_after.invoke(3, 6, go, died)
    got = [yr.get(gen.next(timeout=T), timeout=T) for _ in range(3)]
    open(go, "w").close()  # the first run may now kill its worker
    got += [yr.get(r, timeout=T) for r in gen]
    assert os.path.exists(died)  # it did die once, and ran again
    assert got == [0, 1, 2, 3, 4, 5]  # the rerun's first three items were dropped


def test_instance_death_mid_stream_fails_the_next_ref_with_a_typed_error(yr_cluster, tmp_path):
    go = str(tmp_path / "go")
    h = Tally.invoke()
    gen = h.dies_after.invoke(2, go)
    got = [yr.get(gen.next(timeout=T), timeout=T) for _ in range(2)]
    open(go, "w").close()
    with pytest.raises(yr.YRRuntimeError) as err:
        yr.get(gen.next(timeout=T), timeout=T)
    assert "dies_after" in str(err.value) or h.instance_id in str(err.value), str(err.value)
    with pytest.raises(StopIteration):
        next(gen)
    assert got == [0, 1]


def test_bad_definitions_are_refused_at_decoration():
    with pytest.raises(yr.YRValueError, match="drop return_nums"):
        @yr.invoke(return_nums=2)
        def two_gen():
            yield 1, 2

    with pytest.raises(RuntimeError, match="async generator cannot be a yr task"):
        @yr.invoke
        async def agen():
            yield 1


def test_generator_in_its_own_process_is_refused_at_invoke(yr_cluster):
    isolated = count_up.options(yr.InvokeOptions(env_vars={"GEN_TEST": "1"}))
    with pytest.raises(yr.YRValueError, match="cannot run in its own process"):
        isolated.invoke(1)
