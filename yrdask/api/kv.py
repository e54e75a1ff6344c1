"""yr's KV API (``yr.kv_write``, ``kv_read``, ``kv_set``, ``kv_get``, ``kv_del`` ...).

Keys are ``str``, values ``bytes``.  The store lives in the scheduler (for as long as it
runs), so every driver, task and instance of the cluster sees the same keys: a common side
channel between them.  Rules (see ``yrdask/scheduler/kv.py``): ``ExistenceOpt.NX`` refuses
existing keys, ``ttl_second`` > 0 expires a key, ``WriteMode.NONE_L2_CACHE_EVICT`` keys may
be dropped to make room, and the whole store is bounded by the Dask config
``yrdask.kv.max-bytes`` (256 MiB by default).  ``kv_read`` waits for keys not written yet.

Options with no meaning here are refused, never ignored: there is no second-level cache
(``WRITE_THROUGH_L2_CACHE``, ``WRITE_BACK_L2_CACHE``) and no disk tier (``CacheType.DISK``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from yrdask import protocol as P
from yrdask.errors import (KVExistsError, KVFullError, YRTimeoutError, YRTypeError,
                           YRValueError)
from yrdask.runtime.context import current_lease, current_runtime


class ExistenceOpt(enum.Enum):
    """Whether a write may replace an existing key: ``NONE`` (yes, default) or ``NX`` (no)."""

    NONE = 0
    NX = 1


class WriteMode(enum.Enum):
    """Reliability of a KV value.  yrdask keeps values in the scheduler's memory only."""

    NONE_L2_CACHE = 0
    WRITE_THROUGH_L2_CACHE = 1  # refused: there is no second-level cache
    WRITE_BACK_L2_CACHE = 2  # refused: there is no second-level cache
    NONE_L2_CACHE_EVICT = 3  # the key may be dropped when a later write needs room


class CacheType(enum.Enum):
    """Storage medium: ``MEMORY`` (the scheduler's memory); ``DISK`` is refused."""

    MEMORY = 0
    DISK = 1


class ConsistencyType(enum.Enum):
    """Consistency of ``CreateParam`` (yr's data system): ``PRAM`` or ``CAUSAL``."""

    PRAM = 0
    CAUSAL = 1


@dataclass
class SetParam:
    """Options of one KV write (``kv_set``, ``kv_write_with_param``)."""

    existence: ExistenceOpt = ExistenceOpt.NONE
    write_mode: WriteMode = WriteMode.NONE_L2_CACHE
    ttl_second: int = 0
    cache_type: CacheType = CacheType.MEMORY


@dataclass
class MSetParam:
    """Options of a multi-key write (``kv_m_write_tx``); ``existence`` must be ``NX``."""

    existence: ExistenceOpt = ExistenceOpt.NX
    write_mode: WriteMode = WriteMode.NONE_L2_CACHE
    ttl_second: int = 0
    cache_type: CacheType = CacheType.MEMORY


@dataclass
class CreateParam:
    """yr's data-system options of ``yr.put``."""

    write_mode: WriteMode = WriteMode.NONE_L2_CACHE
    consistency_type: ConsistencyType = ConsistencyType.PRAM
    cache_type: CacheType = CacheType.MEMORY


@dataclass
class GetParam:
    """Read ``size`` bytes from ``offset`` of a value (``size=0``: to its end)."""

    offset: int = 0
    size: int = 0


@dataclass
class GetParams:
    """One :class:`GetParam` per key of ``kv_get_with_param``."""

    get_params: list[GetParam] = field(default_factory=list)


Keys = Union[str, Sequence[str]]


# -- argument checks --------------------------------------------------------------------------


def _key(what: str, key: Any) -> str:
    if not isinstance(key, str):
        raise YRTypeError(f"yr.{what}: key must be a str, got {type(key).__name__}")
    if not key:
        raise YRValueError(f"yr.{what}: key must not be empty")
    return key


def _keys(what: str, key: Any) -> tuple[list[str], bool]:
    """``(keys, single)``: a str is one key, a list of str several."""
    if isinstance(key, str):
        return [_key(what, key)], True
    if not isinstance(key, (list, tuple)) or not key:
        raise YRTypeError(f"yr.{what}: key must be a str or a non-empty list of str, "
                          f"got {key!r}")
    return [_key(what, k) for k in key], False


def _value(what: str, value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        hint = " (encode a str first: value.encode())" if isinstance(value, str) else ""
        raise YRTypeError(f"yr.{what}: value must be bytes, got {type(value).__name__}{hint}")
    return bytes(value)


def _timeout(what: str, timeout: Any, zero_ok: bool) -> float | None:
    """Seconds to wait (``None`` = forever) from yr's ``timeout`` (``-1`` = forever)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int):
        raise YRTypeError(f"yr.{what}: timeout must be an int (seconds, -1 = forever), "
                          f"got {timeout!r}")
    if timeout == -1:
        return None
    if timeout < 0 or (timeout == 0 and not zero_ok):
        raise YRValueError(f"yr.{what}: Parameter 'timeout' should be greater than "
                           f"{'or equal to 0' if zero_ok else '0'} or equal to -1 (no timeout), "
                           f"got {timeout}")
    return float(timeout)


def _write_options(what: str, existence: Any, write_mode: Any, ttl_second: Any,
                   cache_type: Any) -> tuple[bool, float, bool]:
    """``(nx, ttl, evictable)``; options yrdask cannot honour are refused by name."""
    if not isinstance(existence, ExistenceOpt):
        raise YRTypeError(f"yr.{what}: existence must be a yr.ExistenceOpt, got {existence!r}")
    if not isinstance(write_mode, WriteMode):
        raise YRTypeError(f"yr.{what}: write_mode must be a yr.WriteMode, got {write_mode!r}")
    if not isinstance(cache_type, CacheType):
        raise YRTypeError(f"yr.{what}: cache_type must be a yr.CacheType, got {cache_type!r}")
    if isinstance(ttl_second, bool) or not isinstance(ttl_second, int) or ttl_second < 0:
        raise YRValueError(f"yr.{what}: ttl_second must be an int >= 0 (0 = no expiry), "
                           f"got {ttl_second!r}")
    if write_mode in (WriteMode.WRITE_THROUGH_L2_CACHE, WriteMode.WRITE_BACK_L2_CACHE):
        raise YRValueError(
            f"yr.{what}: write_mode={write_mode} needs a second-level cache, which yrdask does "
            "not have (the KV store lives in the scheduler's memory): use "
            "WriteMode.NONE_L2_CACHE, or WriteMode.NONE_L2_CACHE_EVICT for values that may be "
            "dropped to make room")
    if cache_type is CacheType.DISK:
        raise YRValueError(
            f"yr.{what}: cache_type=CacheType.DISK is not supported: the KV store lives in the "
            "scheduler's memory; use CacheType.MEMORY")
    return existence is ExistenceOpt.NX, float(ttl_second), \
        write_mode is WriteMode.NONE_L2_CACHE_EVICT


# -- the calls ---------------------------------------------------------------------------------


def _put(what: str, keys: list[str], values: list[bytes], nx: bool, ttl: float,
         evictable: bool) -> None:
    rt = current_runtime()
    status, payload = rt.run_sync(rt.connector.scheduler_rpc(
        P.KV_PUT, keys=keys, values=values, nx=nx, ttl_s=ttl, evictable=evictable))
    if status == "exists":
        raise KVExistsError(f"yr.{what}: key(s) {list(payload)} already exist and the write "
                            "asked for ExistenceOpt.NX; delete them first (yr.kv_del) or "
                            "write with ExistenceOpt.NONE")
    if status == "full":
        raise KVFullError(f"yr.{what}: {payload}")


def _read(what: str, keys: list[str], timeout: float | None) -> list[bytes]:
    rt = current_runtime()
    lease = current_lease()
    blocked = lease is not None and timeout != 0.0
    if blocked:  # a task waiting here lends its CPU, as in yr.get (no deadlock on 1 CPU)
        rt.connector.notify_blocked(lease, True)
    try:
        status, payload = rt.run_sync(rt.connector.scheduler_rpc(
            P.KV_GET, keys=keys, timeout=timeout))
    finally:
        if blocked:
            rt.connector.notify_blocked(lease, False)
    if status != "ok":
        waited = "forever" if timeout is None else f"{timeout:g} s"
        raise YRTimeoutError(f"yr.{what}: key(s) {list(payload)} not present after waiting "
                             f"{waited}; write them first (yr.kv_write), or raise the timeout "
                             "(-1 waits forever)")
    return [bytes(v) for v in payload]


def kv_write(key: str, value: bytes, existence: ExistenceOpt = ExistenceOpt.NONE,
             write_mode: WriteMode = WriteMode.NONE_L2_CACHE, ttl_second: int = 0,
             cache_type: CacheType = CacheType.MEMORY) -> None:
    """Store ``value`` under ``key`` for the whole cluster (``ttl_second`` 0: no expiry)."""
    k, v = _key("kv_write", key), _value("kv_write", value)
    nx, ttl, evict = _write_options("kv_write", existence, write_mode, ttl_second, cache_type)
    _put("kv_write", [k], [v], nx, ttl, evict)


def _check_param(what: str, param: Any, cls: type) -> Any:
    if not isinstance(param, cls):
        raise YRTypeError(f"yr.{what}: expected a yr.{cls.__name__}, got {param!r}")
    return param


def kv_write_with_param(key: str, value: bytes, set_param: SetParam) -> None:
    """:func:`kv_write` with its options in a :class:`SetParam`."""
    p = _check_param("kv_write_with_param", set_param, SetParam)
    k, v = _key("kv_write_with_param", key), _value("kv_write_with_param", value)
    _put("kv_write_with_param", [k], [v], *_write_options(
        "kv_write_with_param", p.existence, p.write_mode, p.ttl_second, p.cache_type))


def kv_set(key: str, value: bytes, set_param: SetParam | None = None) -> None:
    """:func:`kv_write` with its options in a :class:`SetParam` (default ``SetParam()``)."""
    p = _check_param("kv_set", set_param if set_param is not None else SetParam(), SetParam)
    k, v = _key("kv_set", key), _value("kv_set", value)
    _put("kv_set", [k], [v], *_write_options("kv_set", p.existence, p.write_mode,
                                             p.ttl_second, p.cache_type))


def kv_m_write_tx(keys: list[str], values: list[bytes],
                  m_set_param: MSetParam | None = None) -> None:
    """Write several keys at once, all or none; only ``ExistenceOpt.NX`` (yr: deprecated)."""
    p = _check_param("kv_m_write_tx", m_set_param if m_set_param is not None else MSetParam(),
                     MSetParam)
    ks, _ = _keys("kv_m_write_tx", keys)
    if not isinstance(values, (list, tuple)):
        raise YRTypeError(f"yr.kv_m_write_tx: values must be a list of bytes, got {values!r}")
    vs = [_value("kv_m_write_tx", v) for v in values]
    if len(ks) != len(vs):
        raise YRValueError(f"yr.kv_m_write_tx: arguments list size not equal. keys size is: "
                           f"{len(ks)}, values size is: {len(vs)}.")
    if p.existence is not ExistenceOpt.NX:
        raise YRValueError("yr.kv_m_write_tx: invalid param: existence should be NX.")
    _put("kv_m_write_tx", ks, vs, *_write_options("kv_m_write_tx", p.existence, p.write_mode,
                                                  p.ttl_second, p.cache_type))


def kv_read(key: Keys, timeout: int = 300) -> Union[bytes, list[bytes]]:
    """The value of ``key`` (or the list of values of a list of keys), waiting up to
    ``timeout`` s for keys not written yet (``-1``: forever, ``0``: no wait).

    Raises ``YRTimeoutError`` (a ``RuntimeError``) naming the keys still missing.
    """
    keys, single = _keys("kv_read", key)
    values = _read("kv_read", keys, _timeout("kv_read", timeout, zero_ok=True))
    return values[0] if single else values


def kv_get(key: Keys, timeout: int = 300) -> Union[bytes, list[bytes]]:
    """Like :func:`kv_read`; ``timeout`` must be > 0 or -1, as in yr."""
    keys, single = _keys("kv_get", key)
    values = _read("kv_get", keys, _timeout("kv_get", timeout, zero_ok=False))
    return values[0] if single else values


def kv_get_with_param(keys: list[str], get_params: GetParams, timeout: int = 300) -> list[bytes]:
    """Parts of values: ``get_params.get_params[i]`` (offset, size) applies to ``keys[i]``."""
    p = _check_param("kv_get_with_param", get_params, GetParams)
    ks, _ = _keys("kv_get_with_param", keys)
    if not p.get_params:
        raise YRValueError("yr.kv_get_with_param: Get params does not accept empty list")
    if len(p.get_params) != len(ks):
        raise YRValueError("yr.kv_get_with_param: Get params size is not equal to keys size "
                           f"({len(p.get_params)} params, {len(ks)} keys)")
    for gp in p.get_params:
        _check_param("kv_get_with_param", gp, GetParam)
        for name in ("offset", "size"):
            n = getattr(gp, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise YRValueError(f"yr.kv_get_with_param: GetParam.{name} must be an int >= 0, "
                                   f"got {n!r}")
    values = _read("kv_get_with_param", ks, _timeout("kv_get_with_param", timeout, zero_ok=True))
    return [v[gp.offset:gp.offset + gp.size] if gp.size else v[gp.offset:]
            for v, gp in zip(values, p.get_params)]


def kv_del(key: Keys) -> None:
    """Delete one key or a list of keys (absent keys are ignored)."""
    keys, _ = _keys("kv_del", key)
    rt = current_runtime()
    rt.run_sync(rt.connector.scheduler_rpc(P.KV_DEL, keys=keys))


__all__ = ["ExistenceOpt", "WriteMode", "CacheType", "ConsistencyType", "SetParam", "MSetParam",
           "CreateParam", "GetParam", "GetParams", "kv_write", "kv_write_with_param", "kv_set",
           "kv_m_write_tx", "kv_read", "kv_get", "kv_get_with_param", "kv_del"]
