"""Stateless functions (SPEC §2; yr_api §1.2, programs P1-P4, P16) on embedded and cli clusters."""

from __future__ import annotations

import os
import re
import time

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(180)

T = 60  # seconds: explicit yr.get bound, well under the test time-out


@yr.invoke
def add(n):
    return n + 1


@yr.invoke(return_nums=3)
def three():
    return 1, 2, 3


@yr.invoke(return_nums=0)
def touch(path):
    with open(path, "w") as f:
        f.write("ran")


@yr.invoke(return_nums=3)
def two_for_three():
    return 1, 2


@yr.invoke(return_nums=3)
def int_for_three():
    return 1


@yr.invoke(return_nums=2)
def three_for_two():
    return 1, 2, 3


@yr.invoke
def get_nums():
    return [1, 2, 3]


@yr.invoke
def get_num(x):
    return x


@yr.invoke
def dis_sum(args):
    return sum(args)


@yr.invoke
def sum_refs(refs):
    return sum(yr.get(refs))


@yr.invoke
def type_names(x, y=None):
    return type(x).__name__, type(y).__name__


@yr.invoke
def nested_type_names(items, mapping):
    return [type(i).__name__ for i in items], {k: type(v).__name__ for k, v in mapping.items()}


@yr.invoke
def kw_sum(a, *, b=0):
    return a + b


@yr.invoke
def make_refs(n):
    half = n // 2
    return [yr.put("good") for _ in range(half)] + [get_num.invoke("good") for _ in range(n - half)]


@yr.invoke
def fail_and_count(path):
    with open(path, "a") as f:
        f.write("x\n")
    raise ValueError("fails every time")


@yr.invoke
def fail_twice_then_succeed(path):
    with open(path, "a") as f:
        f.write("x\n")
    with open(path) as f:
        runs = len(f.read().split())
    if runs < 3:
        raise ValueError(f"failing run {runs}")
    return runs


@yr.invoke
def square(i):
    return i * i


@yr.invoke
def signature_echo(a, b=2, *args, c=3, **kw):
    return a, b, args, c, kw


@yr.invoke
def returns_none():
    pass


@yr.invoke
def echo(x):
    return x


@yr.invoke
def length(x):
    return len(x)


@yr.invoke
def double(arr):
    return arr * 2


# --- P1 -------------------------------------------------------------------------------------

def test_p1_invoke_and_chain(yr_cluster):
    ref = add.invoke(1)
    assert yr.get(ref, T) == 2
    assert yr.get(add.invoke(add.invoke(1)), T) == 3
    assert yr.get(add.invoke(add.invoke(add.invoke(1))), T) == 4


def test_p1_direct_call_raises_runtime_error(yr_cluster):
    with pytest.raises(RuntimeError, match="(?i)invoke"):
        add(1)


def test_p1_signature_checked_at_invoke(yr_cluster):
    with pytest.raises(TypeError):
        add.invoke(1, 2)
    with pytest.raises(TypeError):
        add.invoke()
    with pytest.raises(TypeError):
        add.invoke(m=1)
    with pytest.raises(TypeError):
        add.invoke(1, n=2)
    with pytest.raises(TypeError):
        kw_sum.invoke(1, 2)  # b is keyword-only
    assert yr.get(add.invoke(n=4), T) == 5
    assert yr.get(kw_sum.invoke(1, b=2), T) == 3


# --- P2 / P3 --------------------------------------------------------------------------------

def test_p2_return_nums_three(yr_cluster):
    refs = three.invoke()
    assert isinstance(refs, list) and len(refs) == 3
    a, b, c = refs
    assert yr.get([a, b, c], T) == [1, 2, 3]
    assert yr.get(c, T) == 3


def test_p2_return_nums_zero(yr_cluster, tmp_path, wait_until):
    marker = tmp_path / "ran"
    assert touch.invoke(str(marker)) is None
    wait_until(marker.exists, T, "the return_nums=0 task to run")


def test_p3_not_enough_values(yr_cluster):
    refs = two_for_three.invoke()
    assert len(refs) == 3
    for ref in refs:
        with pytest.raises(ValueError, match=re.escape("not enough values to unpack (expected 3, got 2)")):
            yr.get(ref, T)


def test_p3_non_iterable(yr_cluster):
    refs = int_for_three.invoke()
    with pytest.raises(TypeError, match=re.escape("cannot unpack non-iterable <class 'int'> object")):
        yr.get(refs[0], T)


def test_p3_too_many_values(yr_cluster):
    refs = three_for_two.invoke()
    assert len(refs) == 2
    with pytest.raises(ValueError, match=re.escape("(expected 2, got 3)")):
        yr.get(refs[1], T)


# --- P4 -------------------------------------------------------------------------------------

def test_p4_top_level_ref_resolved(yr_cluster):
    assert yr.get(dis_sum.invoke(get_nums.invoke()), T) == 6
    assert yr.get(dis_sum.invoke(yr.put([4, 5])), T) == 9


def test_p4_top_level_keyword_refs_resolved(yr_cluster):
    assert yr.get(type_names.invoke(yr.put(5), y=get_num.invoke("s")), T) == ("int", "str")
    assert yr.get(kw_sum.invoke(yr.put(1), b=add.invoke(1)), T) == 3


def test_p4_nested_refs_arrive_as_refs(yr_cluster):
    refs = [get_num.invoke(1), get_num.invoke(2), get_num.invoke(3)]
    assert yr.get(sum_refs.invoke(refs), T) == 6
    items, mapping = yr.get(nested_type_names.invoke([yr.put(1)], {"k": get_num.invoke(2)}), T)
    assert items == ["ObjectRef"]
    assert mapping == {"k": "ObjectRef"}


def test_p4_put_of_a_list_of_refs(yr_cluster):
    ref = yr.put([get_num.invoke(1), get_num.invoke(2), get_num.invoke(3)])
    assert yr.get(sum_refs.invoke(ref), 30) == 6
    inner = yr.get(ref, T)
    assert isinstance(inner, list) and len(inner) == 3
    assert yr.get(inner, T) == [1, 2, 3]


def test_p4_task_returning_refs(yr_cluster):
    ids = yr.get(make_refs.invoke(10), T)
    assert len(ids) == 10
    assert yr.get(ids, T) == ["good"] * 10


# --- options ----------------------------------------------------------------------------------

def test_options_returns_new_proxy_and_is_not_sticky(yr_cluster):
    # A request no worker can ever meet makes the options observable: it fails at get.
    impossible = add.options(yr.InvokeOptions(cpu=64000, schedule_timeout_ms=1000))
    assert impossible is not add
    doomed = impossible.invoke(1)
    assert yr.get(add.invoke(1), T) == 2, "the original proxy must keep its own options"
    with pytest.raises(yr.YRRuntimeError):
        yr.get(doomed, T)
    # A derived proxy with other (feasible) options runs too; smaller than the default so
    # that it fits wherever the default does.
    other = add.options(yr.InvokeOptions(cpu=300, memory=256))
    assert other is not add and other is not impossible
    assert yr.get(other.invoke(1), T) == 2
    assert yr.get(add.invoke(2), T) == 3


# --- P16 retries --------------------------------------------------------------------------------

def _runs(path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


def test_p16_retry_times_reruns_failing_body(yr_cluster, tmp_path):
    counter = tmp_path / "runs"
    ref = fail_and_count.options(yr.InvokeOptions(retry_times=3)).invoke(str(counter))
    with pytest.raises(ValueError, match="fails every time"):
        yr.get(ref, T)
    assert _runs(counter) == 4


def test_p16_retry_times_zero_runs_once(yr_cluster, tmp_path):
    counter = tmp_path / "runs"
    with pytest.raises(ValueError):
        yr.get(fail_and_count.options(yr.InvokeOptions(retry_times=0)).invoke(str(counter)), T)
    assert _runs(counter) == 1
    plain = tmp_path / "plain"
    with pytest.raises(ValueError):
        yr.get(fail_and_count.invoke(str(plain)), T)
    assert _runs(plain) == 1


def test_p16_retry_until_success(yr_cluster, tmp_path):
    counter = tmp_path / "runs"
    ref = fail_twice_then_succeed.options(yr.InvokeOptions(retry_times=3)).invoke(str(counter))
    assert yr.get(ref, T) == 3
    assert _runs(counter) == 3


# --- shapes of calls and values -----------------------------------------------------------------

def test_fan_out_200_gathered_in_order(yr_cluster):
    refs = [square.invoke(i) for i in range(200)]
    assert yr.get(refs, 120) == [i * i for i in range(200)]


@yr.invoke
def replies_held():
    from yrdask.runtime.context import current_runtime

    return current_runtime().agent.replies_held


def test_a_burst_of_short_tasks_answers_in_runs(yr_cluster):
    """Pipelined short tasks: every result right and in order, and their workers held plain
    answers back while running the next task of the lease (agent._hold_reply)."""
    refs = [add.invoke(i) for i in range(2000)]
    assert yr.get(refs, 120) == [i + 1 for i in range(2000)]
    assert max(yr.get([replies_held.invoke() for _ in range(8)], T)) > 0


def test_kwargs_and_defaults(yr_cluster):
    assert yr.get(signature_echo.invoke(1), T) == (1, 2, (), 3, {})
    assert yr.get(signature_echo.invoke(1, 5, 6, 7, c=8, d=9), T) == (1, 5, (6, 7), 8, {"d": 9})
    assert yr.get(signature_echo.invoke(a=0, c=1), T) == (0, 2, (), 1, {})


def test_task_returning_none(yr_cluster):
    assert yr.get(returns_none.invoke(), T) is None


def test_large_bytes_round_trip(yr_cluster):
    data = os.urandom(20 * 2**20)
    assert yr.get(length.invoke(data), T) == len(data)
    result = yr.get(echo.invoke(data), T)
    assert isinstance(result, memoryview), "top-level bytes come back as a memoryview (yr_api §1.4)"
    assert result == data


def test_large_numpy_round_trip(yr_cluster):
    np = pytest.importorskip("numpy")
    arr = np.arange(20 * 2**20 // 8, dtype=np.float64)
    out = yr.get(double.invoke(arr), T)
    np.testing.assert_array_equal(out, arr * 2)
    out2 = yr.get(double.invoke(yr.put(arr)), T)
    np.testing.assert_array_equal(out2, arr * 2)


@yr.invoke
def _slow_value(x):
    time.sleep(0.3)
    return x


@yr.invoke
def _double(x):
    return 2 * x


@yr.invoke
def _length(b):
    return len(b)


@yr.invoke
def _make_big(n):
    return b"y" * n


@yr.invoke
def _relay_first(refs, fn):
    """Receives refs nested in a list (borrowed, maybe still pending) and passes the first on
    as a top-level argument: its owner elsewhere must serve it, nobody here fetched it."""
    return yr.get(fn.invoke(refs[0]), 60)


def test_borrowed_pending_ref_passed_on_as_argument(yr_cluster):
    assert yr.get(_relay_first.invoke([_slow_value.invoke(21)], _double), 60) == 42


def test_borrowed_large_refs_passed_on_as_argument(yr_cluster):
    n = 2 << 20  # above the inline limit: the value stays where it was made or put
    put_ref = yr.put(b"x" * n)
    assert yr.get(_relay_first.invoke([put_ref], _length), 60) == n
    assert yr.get(_relay_first.invoke([_make_big.invoke(n)], _length), 60) == n
