"""``yr.runtime``: the KV option enums and parameter classes (re-exported from yrdask.api.kv)."""

from yrdask.api.kv import (CacheType, ConsistencyType, CreateParam, ExistenceOpt,  # noqa: F401
                           GetParam, GetParams, MSetParam, SetParam, WriteMode)

__all__ = ["CacheType", "ConsistencyType", "CreateParam", "ExistenceOpt", "GetParam",
           "GetParams", "MSetParam", "SetParam", "WriteMode"]
