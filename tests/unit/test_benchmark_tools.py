"""The benchmark tools that drive yrdask's own objects without a cluster keep working as
those objects change (a stand-in agent that misses a new attribute fails here, not in the
middle of a measurement)."""

from benchmarks import task_path_cpu


def test_task_path_cpu_runs_the_real_task_path_and_answers_every_task():
    assert task_path_cpu.task_path(n=300, rounds=1) > 0.0  # it asserts every task answered


def test_task_path_cpu_runs_the_lending_steps():
    assert task_path_cpu.lend_cycle(n=200) > 0.0
