"""``ray.util.multiprocessing.Pool`` and the joblib ``"ray"`` backend on the embedded cluster.

Semantics checked are those of ``multiprocessing.Pool`` as Ray's Pool gives them (Ray's
``python/ray/util/multiprocessing/pool.py`` and ``test_multiprocessing.py``): results in order,
the initializer once per pool process, errors re-raised at ``get`` with their own type,
``error_callback`` with the first error, ``close``/``join``/``terminate``,
``maxtasksperchild``.  Pool processes are processes of their own, so per-process state is
shown through ``os.environ`` and pids; waits are rendezvous (a Queue), never sleeps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import cloudpickle
import psutil
import pytest

from yrdask.ray.util.multiprocessing import Pool, TimeoutError
from yrdask.ray.util.queue import Queue

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


def _init(tag):
    """Counts its runs in this process's environment (state that stays with the process)."""
    os.environ["POOL_INITS"] = str(int(os.environ.get("POOL_INITS", "0")) + 1)
    os.environ["POOL_TAG"] = tag


def _where(x):
    return x, os.getpid(), os.environ.get("POOL_TAG"), os.environ.get("POOL_INITS")


def _square(x):
    return x * x


def _fail_on_three(x):
    if x == 3:
        raise KeyError(x)
    return x


def _held(item):
    """Item 0 waits for the test's go; item 1 tells the test it ran."""
    go, ran, x = item
    if x == 0:
        go.get(timeout=60)
    else:
        ran.put(x)
    return x


def _pid(_):
    return os.getpid()


def _block(q):
    return q.get(timeout=60)


def test_each_method_returns_results_in_order(ray_env):
    with Pool(2) as pool:
        xs = list(range(11))
        squares = [x * x for x in xs]
        assert pool.map(_square, xs) == squares
        assert pool.map(_square, xs, chunksize=1) == squares
        assert pool.map(_square, xs, chunksize=4) == squares
        assert pool.map(_square, []) == []
        assert pool.map_async(_square, xs, chunksize=3).get(timeout=60) == squares
        assert pool.starmap(pow, [(2, 3), (3, 2), (5, 0)]) == [8, 9, 1]
        assert pool.starmap_async(pow, [(2, 5)]).get(timeout=60) == [32]
        assert pool.apply(divmod, (7, 2)) == (3, 1)
        assert pool.apply(int, ("ff",), {"base": 16}) == 255
        res = pool.apply_async(_square, (9,))
        assert res.get(timeout=60) == 81 and res.ready() and res.successful()
        # imap takes an iterator with no len(), lazily, in chunks
        assert list(pool.imap(_square, iter(xs), chunksize=3)) == squares
        assert sorted(pool.imap_unordered(_square, xs)) == squares


def test_imap_keeps_order_and_imap_unordered_gives_finishing_order(ray_env):
    go, ran = Queue(), Queue()
    try:
        with Pool(2) as pool:
            it = pool.imap_unordered(_held, [(go, ran, 0), (go, ran, 1)])
            assert next(it) == 1  # item 0 cannot finish before the go below
            assert ran.get(timeout=60) == 1
            go.put("go")
            assert list(it) == [0]
            it = pool.imap(_held, [(go, ran, 0), (go, ran, 1)])
            assert ran.get(timeout=60) == 1
            with pytest.raises(TimeoutError):  # item 1 is done, but item 0 comes first
                it.next(timeout=0.2)
            go.put("go")
            assert list(it) == [0, 1]
    finally:
        go.shutdown()
        ran.shutdown()


def test_initializer_runs_once_in_each_pool_process(ray_env):
    with Pool(2, initializer=_init, initargs=("t1",)) as pool:
        out = pool.map(_where, range(20), chunksize=2)
    assert [x for x, *_ in out] == list(range(20))
    pids = {pid for _, pid, _, _ in out}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {(tag, inits) for _, _, tag, inits in out} == {("t1", "1")}


def test_errors_are_raised_at_get_with_their_type_and_go_to_error_callback(ray_env):
    seen, called = [], threading.Event()
    with Pool(2) as pool:
        with pytest.raises(KeyError) as info:
            pool.apply(_fail_on_three, (3,))
        assert info.value.args == (3,)
        with pytest.raises(KeyError):
            pool.map(_fail_on_three, range(6))
        res = pool.map_async(_fail_on_three, range(6), chunksize=1,
                             callback=lambda v: seen.append(("ok", v)),
                             error_callback=lambda e: (seen.append(e), called.set()))
        with pytest.raises(KeyError):
            res.get(timeout=60)
        assert called.is_set() and len(seen) == 1 and isinstance(seen[0], KeyError)
        assert res.ready() and not res.successful()
        got = []
        res = pool.apply_async(_square, (4,), callback=got.append,
                               error_callback=lambda e: got.append(("err", e)))
        assert res.get(timeout=60) == 16 and got == [16]  # the callback ran before ready
        it = pool.imap(_fail_on_three, range(5))
        assert [next(it) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(KeyError):
            next(it)
        assert list(it) == [4]


def test_close_lets_work_finish_and_join_waits_for_the_processes(ray_env, wait_until):
    q = Queue()
    try:
        pool = Pool(2)
        pids = set(pool.map(_pid, range(4), chunksize=1))
        with pytest.raises(ValueError, match="still running"):
            pool.join()
        pending = pool.apply_async(_block, (q,))
        pool.close()
        with pytest.raises(ValueError, match="Pool not running"):
            pool.apply(_square, (1,))
        with pytest.raises(TimeoutError):
            pending.get(timeout=0.2)
        q.put("done")
        assert pending.get(timeout=60) == "done"
        pool.join()
        wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30,
                   "the pool's processes to end after join")
    finally:
        q.shutdown()


def test_terminate_ends_running_work(ray_env):
    import yrdask.ray as ray

    q = Queue()
    try:
        pool = Pool(2)
        pending = pool.apply_async(_block, (q,))
        assert not pending.ready()
        pool.terminate()
        with pytest.raises(ray.exceptions.RayActorError):
            pending.get(timeout=60)
        pool.join()
        with pytest.raises(ValueError, match="Pool not running"):
            pool.map(_square, [1])
    finally:
        q.shutdown()


def test_maxtasksperchild_replaces_a_process_after_its_chunks(ray_env):
    with Pool(2, initializer=_init, initargs=("m",), maxtasksperchild=2) as pool:
        out = pool.map(_where, range(8), chunksize=1)
    by_pid: dict = {}
    for _, pid, _, inits in out:
        by_pid.setdefault(pid, []).append(inits)
    assert len(by_pid) == 4
    assert all(v == ["1", "1"] for v in by_pid.values()), by_pid


def test_bad_arguments_are_refused_at_the_call(ray_env):
    with pytest.raises(ValueError, match="processes"):
        Pool(0)
    with pytest.raises(ValueError, match="CPUs"):
        Pool(1000)
    with pytest.raises(ValueError, match="context"):
        Pool(1, context=object())
    with pytest.raises(TypeError, match="initializer"):
        Pool(1, initializer=3)
    with Pool(1) as pool:
        with pytest.raises(ValueError, match="chunksize"):
            pool.map(_square, [1], chunksize=0)


def test_joblib_parallel_runs_on_the_pool(ray_env):
    joblib = pytest.importorskip("joblib")
    from yrdask.ray.util.joblib import register_ray

    register_ray()
    with joblib.parallel_backend("ray"):
        out = joblib.Parallel(n_jobs=2)(joblib.delayed(_where)(i) for i in range(10))
        assert [x for x, *_ in out] == list(range(10))
        assert os.getpid() not in {pid for _, pid, _, _ in out}
        with pytest.raises(KeyError):
            joblib.Parallel(n_jobs=2)(joblib.delayed(_fail_on_three)(i) for i in range(5))
    with joblib.parallel_backend("ray", n_jobs=-1) as (backend, n_jobs):
        assert backend.effective_n_jobs(n_jobs) == 2  # the cluster's CPUs


def test_register_ray_names_the_missing_package(monkeypatch):
    from yrdask.ray.util import joblib as ray_joblib

    monkeypatch.setitem(sys.modules, "joblib", None)
    with pytest.raises(ImportError, match="pip install joblib"):
        ray_joblib.register_ray()


def test_ray_alias_gives_the_new_modules():
    code = ("import ray.util.multiprocessing as m, ray.util.joblib as j, yrdask.ray.util;"
            "from ray.util.multiprocessing import Pool;"
            "assert Pool is yrdask.ray.util.multiprocessing.Pool;"
            "assert j is yrdask.ray.util.joblib and 'joblib' not in __import__('sys').modules;"
            "print('ok')")
    out = subprocess.run([sys.executable, "-m", "yrdask.ray", "-c", code], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
