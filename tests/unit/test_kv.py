"""Unit tests of the scheduler's KV store rules (yrdask/scheduler/kv.py), without I/O."""

from __future__ import annotations

import pytest

from yrdask.scheduler.kv import CONFIG_KEY, KVExists, KVFull, KVStore, Ready

pytestmark = pytest.mark.timeout(30)


def test_put_get_overwrite_and_delete():
    s = KVStore()
    assert s.put(["a"], [b"1"], now=0) == []
    assert s.get(["a", "b"], now=0) == ([b"1"], ["b"])
    s.put(["a"], [b"22"], now=1)
    assert s.get(["a"], now=1) == ([b"22"], [])
    assert s.nbytes == len("a") + 2
    assert s.delete(["a", "missing", "a"], now=2) == 1
    assert s.get(["a"], now=2) == ([], ["a"]) and s.nbytes == 0


def test_nx_refuses_existing_keys_and_writes_nothing():
    s = KVStore()
    s.put(["a"], [b"1"], now=0)
    with pytest.raises(KVExists) as e:
        s.put(["b", "a"], [b"x", b"y"], now=0, nx=True)
    assert e.value.keys == ["a"]
    assert s.get(["a", "b"], now=0) == ([b"1"], ["b"])  # all or nothing
    s.put(["b"], [b"x"], now=0, nx=True)
    assert s.get(["b"], now=0) == ([b"x"], [])


def test_ttl_expires_on_access_and_by_sweep():
    s = KVStore()
    s.put(["t"], [b"v"], now=10, ttl=5)
    s.put(["u"], [b"w"], now=10, ttl=5)
    s.put(["forever"], [b"f"], now=10)
    assert s.get(["t"], now=14.9) == ([b"v"], [])
    assert s.get(["t"], now=15) == ([], ["t"])  # expired: reads as missing, and is gone
    assert "t" not in s.items
    assert s.sweep(now=100) == ["u"]
    assert list(s.items) == ["forever"] and s.nbytes == len("forever") + 1
    # an expired key no longer blocks an NX write
    s.put(["x"], [b"1"], now=0, ttl=1)
    s.put(["x"], [b"2"], now=2, nx=True)
    assert s.get(["x"], now=2) == ([b"2"], [])


def test_size_bound_names_the_bound_and_the_config_key():
    s = KVStore(max_bytes=10)
    s.put(["a"], [b"12345"], now=0)  # 6 bytes
    with pytest.raises(KVFull) as e:
        s.put(["b"], [b"123456"], now=0)  # 7 more: 13 > 10
    msg = str(e.value)
    assert "10 bytes" in msg and CONFIG_KEY in msg and "13" in msg
    assert s.get(["b"], now=0) == ([], ["b"]) and s.nbytes == 6
    s.put(["a"], [b"123456789"], now=0)  # replacing a key frees its old size first
    assert s.nbytes == 10


def test_evictable_keys_make_room_oldest_first():
    s = KVStore(max_bytes=12)
    s.put(["e1"], [b"aaaa"], now=0, evictable=True)  # 6
    s.put(["e2"], [b"bbbb"], now=1, evictable=True)  # 6
    s.put(["k"], [b"cccc"], now=2)  # needs 6: e1, the oldest, goes
    assert sorted(s.items) == ["e2", "k"]
    with pytest.raises(KVFull):
        s.put(["big"], [b"x" * 20], now=3)  # evicting everything evictable is not enough
    assert sorted(s.items) == ["e2", "k"]  # and nothing was dropped for it


def test_waiters_are_answered_when_all_their_keys_are_written():
    s = KVStore()
    s.put(["a"], [b"1"], now=0)
    assert s.wait("w1", ["a"], now=0) == [b"1"]  # present: answered at once
    assert s.wait("w2", ["a", "b", "c"], now=0) is None
    assert s.put(["b"], [b"2"], now=1) == []
    assert s.put(["c"], [b"3"], now=2) == [Ready("w2", [b"1", b"2", b"3"])]
    assert s.waiters == {} and s.waiting_on == {}


def test_cancelled_waiter_is_forgotten():
    s = KVStore()
    assert s.wait("w", ["k"], now=0) is None
    assert s.cancel_wait("w") == ["k"]
    assert s.cancel_wait("w") == []
    assert s.put(["k"], [b"v"], now=1) == []
    assert s.waiters == {} and s.waiting_on == {}


def test_waiter_whose_other_key_expired_keeps_waiting():
    s = KVStore()
    s.put(["a"], [b"1"], now=0, ttl=1)
    assert s.wait("w", ["a", "b"], now=0) is None
    assert s.put(["b"], [b"2"], now=5) == []  # "a" expired meanwhile
    assert s.put(["a"], [b"3"], now=6) == [Ready("w", [b"3", b"2"])]


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        KVStore().put(["a", "b"], [b"1"], now=0)
