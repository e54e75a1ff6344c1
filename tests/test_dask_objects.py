"""Dask's objects and yr's meet (docs/objects.md, "Dask objects and ObjectRefs"): Dask Futures
and delayed values as arguments of yr and Ray tasks and methods and in get/wait, and
ObjectRefs as inputs of Dask graphs, read from the node's store without a copy."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import yrdask as yr
from yrdask import dask as ydask
from yrdask.runtime.context import current_runtime
from yrdask.runtime.dask_objects import close_dask_client

pytestmark = pytest.mark.timeout(120)

T = 60  # seconds: explicit get bound, under the test time-out
BIG = 200_000  # float64 items: 1.6 MB, over the inline limit, so the value is in the store


@yr.invoke
def total(x):
    return float(np.sum(x))


@yr.invoke
def read_nested(items):
    """What a task sees of a list holding a Dask object: a ref, read as a ref is read."""
    return [type(items[0]).__name__, float(np.sum(yr.get(items[0], T))), items[1]]


@yr.instance
class Adder:
    def __init__(self, base):
        self.base = base

    def add(self, x, more=0):
        return self.base + float(np.sum(x)) + float(np.sum(more))


def make(n):
    return np.arange(float(n))


def fail():
    raise ZeroDivisionError("dask task failed on purpose")


def where(pid_of: int = 0):
    return os.getpid()


def mapped_from(arr):
    """(a Dask task) Which file the array's memory is mapped from, and if it is writeable."""
    address = arr.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(v, 16) for v in line.split()[0].split("-"))
            if low <= address < high:
                return line.split()[-1], bool(arr.flags.writeable), os.getpid()
    return None, bool(arr.flags.writeable), os.getpid()


@pytest.fixture
def client(cluster):
    """The Dask client of the suite's embedded cluster, closed after the test (it is the
    default client meanwhile, which later modules must not inherit)."""
    cluster()
    yield ydask.get_client()
    close_dask_client(current_runtime())


def test_a_future_is_a_task_argument_top_level_keyword_and_nested(client):
    fut = client.submit(make, 10, pure=False)
    assert yr.get(total.invoke(fut), T) == 45.0
    assert yr.get(Adder.invoke(1).add.invoke(fut, more=fut), T) == 91.0
    kind, value, other = yr.get(read_nested.invoke([fut, "x"]), T)
    assert (kind, value, other) == ("ObjectRef", 45.0, "x")


def test_get_and_wait_take_futures_and_delayed_values(client):
    import dask

    fut = client.submit(make, 4, pure=False)
    ref = yr.put(7)
    assert list(yr.get(fut, T)) == [0.0, 1.0, 2.0, 3.0]
    assert yr.get([ref, fut], T)[0] == 7
    assert yr.get(dask.delayed(sum)([1, 2, 3]), T) == 6
    ready, not_ready = yr.wait([fut, ref], timeout=T)
    assert ready == [fut, ref] and not_ready == []  # the objects come back as given
    # nested in a put value (small, with a buffer: pickled twice): one ref per Future
    box = yr.get(yr.put([fut, np.arange(3), fut]), T)
    assert isinstance(box[0], yr.ObjectRef) and box[0] == box[2]
    assert list(yr.get(box[0], T)) == [0.0, 1.0, 2.0, 3.0]


def test_a_delayed_argument_is_computed_on_the_cluster(client):
    import dask

    pid = yr.get(total.invoke(dask.delayed(where)()), T)  # sum of one pid
    assert pid != os.getpid(), "the delayed value was computed in the driver"
    assert yr.get(total.invoke(dask.delayed(make)(5)), T) == 10.0


def test_a_failed_future_fails_the_task_and_get_with_dasks_error(client):
    fut = client.submit(fail, pure=False)
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        yr.get(total.invoke(fut), T)
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        yr.get(fut, T)
    # nested, yr's rule for a failed nested ref: the task does not run
    with pytest.raises(yr.DependencyError, match="ZeroDivisionError: dask task failed"):
        yr.get(read_nested.invoke([fut, 1]), T)


def test_futures_of_a_closed_client_or_another_cluster_are_refused(client):
    from distributed import Client, LocalCluster

    other = Client(client.scheduler.address, set_as_default=False)
    fut = other.submit(make, 3, pure=False)
    fut.result(T)
    other.close()
    with pytest.raises(yr.YRRuntimeError, match="closed"):
        total.invoke(fut)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as local, \
            Client(local, set_as_default=False) as elsewhere:
        fut = elsewhere.submit(make, 3, pure=False)
        with pytest.raises(yr.YRRuntimeError, match="belongs to the cluster at"):
            total.invoke([fut])
        with pytest.raises(yr.YRRuntimeError, match="belongs to the cluster at"):
            yr.get(fut, T)
        del fut


def test_ray_tasks_actors_get_and_wait_take_futures(ray_env, client):
    ray = ray_env

    @ray.remote
    def plus_one(x):
        return float(np.sum(x)) + 1

    @ray.remote
    class Keeper:
        def first(self, items):
            return float(np.sum(ray.get(items[0])))

    fut = client.submit(make, 10, pure=False)
    assert ray.get(plus_one.remote(fut)) == 46.0
    assert ray.get(Keeper.remote().first.remote([fut])) == 45.0
    assert list(ray.get(fut)) == list(make(10))
    assert ray.wait([fut], timeout=T) == ([fut], [])
    failed = client.submit(fail, pure=False)
    with pytest.raises(ZeroDivisionError):
        ray.get(plus_one.remote(failed))
    with pytest.raises(ray.exceptions.RayTaskError) as caught:  # nested: read in the actor
        ray.get(Keeper.remote().first.remote([failed]))
    assert isinstance(caught.value, ZeroDivisionError)


def test_a_dask_array_of_refs_reads_the_store_without_a_copy(client):
    put_ref = yr.put(make(BIG))
    task_ref = yr.invoke(make).invoke(BIG)  # a large result, in the store of its worker's node
    arr = ydask.from_numpy_refs([put_ref, task_ref])
    assert arr.shape == (2 * BIG,) and arr.chunks == ((BIG, BIG),)
    assert float(arr.sum().compute()) == 2 * float(make(BIG).sum())
    told = ydask.from_numpy_refs(put_ref, shape=(BIG,), dtype="float64")  # nothing read here
    assert told.dtype == np.float64 and float(told[-1].compute()) == BIG - 1
    import dask

    for ref in (put_ref, task_ref):
        path, writeable, pid = dask.delayed(mapped_from)(ydask.to_delayed(ref)).compute()
        assert pid != os.getpid()  # read by a Dask task on a worker
        assert path is not None and path.startswith("/dev/shm/yrdask-"), path
        assert path.endswith(f"/objects/{ref.id}"), (path, ref.id)
        assert not writeable


def test_a_dask_dataframe_of_refs_groups_as_pandas_does(client):
    pd = pytest.importorskip("pandas")

    @yr.invoke
    def part(i):
        return pd.DataFrame({"key": np.arange(BIG) % 3, "value": np.full(BIG, float(i))})

    refs = [part.invoke(i) for i in range(3)]
    ddf = ydask.from_pandas_refs(refs)
    assert ddf.npartitions == 3
    got = ddf.groupby("key")["value"].sum().compute().sort_index()
    want = pd.concat(yr.get(refs, T)).groupby("key")["value"].sum().sort_index()
    pd.testing.assert_series_equal(got, want)
    import dask

    column = dask.delayed(lambda df: df["value"].to_numpy())(ydask.to_delayed(refs[1]))
    path, _writeable, _pid = dask.delayed(mapped_from)(column).compute()
    assert path is not None and path.endswith(f"/objects/{refs[1].id}"), path


def test_bad_input_is_named(client):
    with pytest.raises(yr.YRTypeError, match="takes an ObjectRef"):
        ydask.to_delayed("not a ref")
    with pytest.raises(yr.YRValueError, match="no refs"):
        ydask.from_numpy_refs([])
    with pytest.raises(yr.YRTypeError, match=r"refs\[0\] holds a int, not a numpy.ndarray"):
        ydask.from_numpy_refs([yr.put(1)])
    with pytest.raises(yr.YRTypeError, match="not a pandas.DataFrame"):
        ydask.from_pandas_refs([yr.put("text")])


def test_a_pickled_future_without_a_client_is_refused(client):
    import pickle

    fut = client.submit(make, 2, pure=False)
    unbound = pickle.loads(pickle.dumps(fut))  # outside yr's packing: Dask's own pickle
    assert unbound._client is None  # Dask's rule: it binds to no client by itself
    with pytest.raises(yr.YRTypeError, match="bound to no Client"):
        total.invoke(unbound)


def test_importing_yrdask_imports_no_dask_collections():
    code = ("import sys, yrdask, yrdask.dask; "
            "print(sorted(m for m in ('dask.array', 'dask.dataframe', 'pandas', 'distributed') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
