"""The benchmark tools that drive yrdask's own objects without a cluster keep working as
those objects change (a stand-in agent that misses a new attribute fails here, not in the
middle of a measurement)."""

import threading

from benchmarks import task_path_cpu


def in_a_thread_of_its_own(fn, *args, **kwargs):
    """``fn``'s result, run in a thread that ends with it: the tool runs tasks inline in its
    calling thread, and what a task leaves in that thread's locals must not reach other
    tests."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    t.start()
    t.join(60)
    assert out, f"{fn.__name__} raised or did not finish (see the thread's traceback above)"
    return out[0]


def test_task_path_cpu_runs_the_real_task_path_and_answers_every_task():
    # it asserts itself that every task answered
    assert in_a_thread_of_its_own(task_path_cpu.task_path, n=300, rounds=1) > 0.0


def test_task_path_cpu_runs_the_lending_steps():
    assert in_a_thread_of_its_own(task_path_cpu.lend_cycle, n=200) > 0.0


def test_owner_path_cpu_runs_the_real_owner_path_and_settles_every_task():
    from benchmarks import owner_path_cpu

    assert owner_path_cpu.one_round(500, 4, 2) > 0.0  # it asserts every task settled
