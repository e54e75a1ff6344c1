"""Resources and placement (SPEC §6) on a cli cluster: one worker tagged gpu_node=1, one plain."""

from __future__ import annotations

import os
import time

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(180)

T = 60  # seconds: explicit yr.get bound, well under the test time-out

GPU = yr.InvokeOptions(custom_resources={"gpu_node": 1})


@yr.invoke
def pid():
    return os.getpid()


@yr.invoke(invoke_options=GPU)
def pid_on_gpu():
    return os.getpid()


@yr.invoke(invoke_options=yr.InvokeOptions(custom_resources={"gpu_node": 1}))
def hold_gpu(seconds):
    start = time.time()
    time.sleep(seconds)
    return os.getpid(), start, time.time()


def test_tag_places_work_on_the_tagged_worker(cli_cluster):
    gpu = cli_cluster.cli.worker_with("gpu_node")
    gpu_pids = gpu.pids()
    other_pids = set().union(*(w.pids() for w in cli_cluster.cli.workers if w is not gpu))
    for _ in range(10):
        got = yr.get(pid_on_gpu.invoke(), T)
        assert got in gpu_pids, f"task ran in pid {got}, not in the gpu_node worker {gpu_pids}"
        assert got not in other_pids
    # also when submitted all at once
    pids = yr.get([pid_on_gpu.invoke() for _ in range(10)], T)
    assert set(pids) <= gpu_pids


def test_options_tag_places_work_on_the_tagged_worker(cli_cluster):
    gpu_pids = cli_cluster.cli.worker_with("gpu_node").pids()
    got = yr.get([pid.options(GPU).invoke() for _ in range(5)], T)
    assert set(got) <= gpu_pids


def test_untagged_work_runs_on_cluster_workers(cli_cluster):
    got = yr.get([pid.invoke() for _ in range(10)], T)
    assert set(got) <= cli_cluster.worker_pids()
    assert os.getpid() not in got


def test_unknown_tag_fails_after_schedule_timeout(cli_cluster):
    opts = yr.InvokeOptions(custom_resources={"no_such_tag": 1}, schedule_timeout_ms=1000)
    start = time.monotonic()
    ref = pid.options(opts).invoke()
    with pytest.raises(yr.YRRuntimeError) as info:
        yr.get(ref, T)
    elapsed = time.monotonic() - start
    assert "no_such_tag" in str(info.value), f"error does not name the missing tag: {info.value}"
    assert 0.9 <= elapsed < 10, f"failed after {elapsed:.1f} s, schedule_timeout_ms=1000"


def test_cpu_larger_than_any_worker_fails_naming_cpu(cli_cluster):
    opts = yr.InvokeOptions(cpu=64000, schedule_timeout_ms=1000)
    start = time.monotonic()
    ref = pid.options(opts).invoke()
    with pytest.raises(yr.YRRuntimeError) as info:
        yr.get(ref, T)
    assert "cpu" in str(info.value).lower(), f"error does not name CPU: {info.value}"
    assert time.monotonic() - start < 10


def test_tag_requests_queue_behind_each_other(cli_cluster):
    gpu_pids = cli_cluster.cli.worker_with("gpu_node").pids()
    start = time.monotonic()
    refs = [hold_gpu.invoke(1.0) for _ in range(2)]
    results = yr.get(refs, T)
    elapsed = time.monotonic() - start
    assert elapsed >= 2.0, f"two 1 s tasks needing the only gpu_node took {elapsed:.2f} s"
    (pid1, s1, e1), (pid2, s2, e2) = sorted(results, key=lambda r: r[1])
    assert {pid1, pid2} <= gpu_pids
    assert s2 >= e1 - 0.05, "the two gpu_node tasks overlapped in time"
