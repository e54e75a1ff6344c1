"""yr's KV API on real clusters (yr_api §1.12): the scheduler keeps the keys, every driver, task
and instance sees them; NX, ttl, the size bound, waiting reads and typed errors.

Runs on both core cluster kinds (``yr_cluster``: embedded and cli).
"""

from __future__ import annotations

import threading
import uuid

import distributed
import pytest

import yrdask as yr
from conftest import wait_until

pytestmark = pytest.mark.timeout(120)

T = 60  # seconds: explicit bounds, well under the test time-out


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def on_scheduler(address: str, fn):
    with distributed.Client(address, set_as_default=False, timeout=30) as client:
        return client.run_on_scheduler(fn)


def kv_waiters(address: str) -> int:
    return on_scheduler(address, lambda dask_scheduler:
                        len(dask_scheduler.extensions["yr"].kv.store.waiters))


@yr.invoke
def read_key(key: str, timeout: int = 30) -> bytes:
    return yr.kv_read(key, timeout)


@yr.invoke
def write_key(key: str, value: bytes) -> None:
    yr.kv_write(key, value)


@yr.invoke
def announce_then_read(marker: str, key: str) -> bytes:
    yr.kv_write(marker, b"reading")
    return yr.kv_read(key, T)


@yr.instance
class Reader:
    def read(self, key: str) -> bytes:
        return yr.kv_read(key, 30)


# -- no cluster needed: arguments are checked first ----------------------------------------


@pytest.mark.parametrize("call,exc,text", [
    (lambda: yr.kv_write("k", b"v", write_mode=yr.WriteMode.WRITE_THROUGH_L2_CACHE),
     yr.YRValueError, "second-level cache"),
    (lambda: yr.kv_write("k", b"v", write_mode=yr.WriteMode.WRITE_BACK_L2_CACHE),
     yr.YRValueError, "second-level cache"),
    (lambda: yr.kv_write("k", b"v", cache_type=yr.CacheType.DISK), yr.YRValueError,
     "CacheType.DISK"),
    (lambda: yr.kv_write("k", "text"), yr.YRTypeError, "encode"),
    (lambda: yr.kv_write("", b"v"), yr.YRValueError, "empty"),
    (lambda: yr.kv_write("k", b"v", ttl_second=-1), yr.YRValueError, "ttl_second"),
    (lambda: yr.kv_write("k", b"v", existence=1), yr.YRTypeError, "ExistenceOpt"),
    (lambda: yr.kv_set("k", b"v", yr.SetParam(cache_type=yr.CacheType.DISK)), yr.YRValueError,
     "DISK"),
    (lambda: yr.kv_get("k", 0), yr.YRValueError, "timeout"),
    (lambda: yr.kv_read("k", -2), yr.YRValueError, "timeout"),
    (lambda: yr.kv_read(["k", 3]), yr.YRTypeError, "key"),
    (lambda: yr.kv_get_with_param(["k"], yr.GetParams([])), yr.YRValueError, "empty"),
    (lambda: yr.kv_get_with_param(["k", "l"], yr.GetParams([yr.GetParam()])), yr.YRValueError,
     "not equal"),
    (lambda: yr.kv_m_write_tx(["a"], [b"1"], yr.MSetParam(existence=yr.ExistenceOpt.NONE)),
     yr.YRValueError, "NX"),
])
def test_bad_arguments_raise_typed_errors_naming_the_option(call, exc, text):
    with pytest.raises(exc, match=text):
        call()


# -- on the cluster ------------------------------------------------------------------------


def test_write_read_delete_from_the_driver(yr_cluster):
    k1, k2 = uniq("a"), uniq("b")
    yr.kv_write(k1, b"one")
    yr.kv_set(k2, bytearray(b"two"))
    assert yr.kv_read(k1) == b"one"
    assert yr.kv_get([k1, k2]) == [b"one", b"two"]
    yr.kv_write(k1, b"uno")  # ExistenceOpt.NONE replaces
    assert yr.kv_read(k1, 0) == b"uno"
    yr.kv_del([k1, k2, uniq("never-written")])
    with pytest.raises(yr.YRTimeoutError, match=k1):
        yr.kv_read(k1, 0)


def test_tasks_and_instances_read_what_the_driver_wrote_and_the_driver_reads_theirs(yr_cluster):
    key, back = uniq("from-driver"), uniq("from-task")
    yr.kv_write(key, b"hello")
    assert yr.get(read_key.invoke(key), T) == b"hello"
    reader = Reader.invoke()
    assert yr.get(reader.read.invoke(key), T) == b"hello"
    yr.get(write_key.invoke(back, b"from a task"), T)
    assert yr.kv_read(back, T) == b"from a task"
    reader.terminate(is_sync=True)
    yr.kv_del([key, back])


def test_nx_refuses_an_existing_key(yr_cluster):
    key = uniq("nx")
    yr.kv_write(key, b"first", existence=yr.ExistenceOpt.NX)
    with pytest.raises(yr.KVExistsError, match=key) as e:
        yr.kv_write(key, b"second", existence=yr.ExistenceOpt.NX)
    assert isinstance(e.value, RuntimeError)
    assert yr.kv_read(key) == b"first"
    a, b = uniq("tx"), key
    with pytest.raises(yr.KVExistsError):  # all or nothing
        yr.kv_m_write_tx([a, b], [b"x", b"y"])
    with pytest.raises(yr.YRTimeoutError):
        yr.kv_read(a, 0)
    yr.kv_del(key)


def test_ttl_expires_a_key(yr_cluster):
    key = uniq("ttl")
    yr.kv_write(key, b"short-lived", ttl_second=3)
    yr.kv_write(key + "-kept", b"kept")

    def gone() -> bool:
        try:
            yr.kv_read(key, 0)
            return False
        except yr.YRTimeoutError:
            return True

    wait_until(gone, 30, f"key {key} to expire")
    assert yr.kv_read(key + "-kept", 0) == b"kept"
    yr.kv_del(key + "-kept")


def test_read_waits_for_a_later_write(yr_cluster):
    key = uniq("later")
    got: list = []
    reader = threading.Thread(target=lambda: got.append(yr.kv_read(key, T)))
    reader.start()
    wait_until(lambda: kv_waiters(yr_cluster.address) >= 1, 30, "the read to wait on the scheduler")
    yr.kv_write(key, b"finally")
    reader.join(T)
    assert got == [b"finally"]
    yr.kv_del(key)


def test_a_task_waits_for_a_key_the_driver_writes_later(yr_cluster):
    marker, key = uniq("marker"), uniq("late")
    ref = announce_then_read.invoke(marker, key)
    assert yr.kv_read(marker, T) == b"reading"
    wait_until(lambda: kv_waiters(yr_cluster.address) >= 1, 30, "the task's read to wait")
    yr.kv_write(key, b"late value")
    assert yr.get(ref, T) == b"late value"
    yr.kv_del([marker, key])


def test_missing_key_times_out_with_a_runtime_error_naming_it(yr_cluster):
    key = uniq("missing")
    with pytest.raises(RuntimeError, match=key) as e:
        yr.kv_read([key], 1)
    assert isinstance(e.value, yr.YRTimeoutError)
    with pytest.raises(RuntimeError, match=key):  # inside a task too (its traceback says so)
        yr.get(read_key.invoke(key, 1), T)


def test_get_with_param_reads_parts(yr_cluster):
    a, b = uniq("p"), uniq("q")
    yr.kv_write(a, b"0123456789")
    yr.kv_write(b, b"abcdef")
    params = yr.GetParams([yr.GetParam(offset=2, size=3), yr.GetParam(offset=4)])
    assert yr.kv_get_with_param([a, b], params, T) == [b"234", b"ef"]
    yr.kv_del([a, b])


def test_size_bound_is_a_typed_error_naming_the_bound_and_config_key(yr_cluster):
    address = yr_cluster.address
    on_scheduler(address, lambda: __import__("dask").config.set({"yrdask.kv.max-bytes": 4096}))
    try:
        key = uniq("big")
        with pytest.raises(yr.KVFullError, match="yrdask.kv.max-bytes") as e:
            yr.kv_write(key, b"x" * 5000)
        assert "4096 bytes" in str(e.value) and isinstance(e.value, RuntimeError)
        yr.kv_write(key, b"x" * 100)  # small values still fit
        evictable = uniq("evict")
        yr.kv_write(evictable, b"e" * 3000, write_mode=yr.WriteMode.NONE_L2_CACHE_EVICT)
        yr.kv_write(key, b"y" * 2000)  # needs room: the evictable key makes it
        with pytest.raises(yr.YRTimeoutError):
            yr.kv_read(evictable, 0)
        yr.kv_del(key)
    finally:
        on_scheduler(address, lambda: __import__("dask").config.set(
            {"yrdask.kv.max-bytes": 256 * 2**20}))

