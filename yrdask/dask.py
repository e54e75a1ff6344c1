"""yr objects in Dask graphs, and the Dask client of yr's cluster (docs/objects.md, "Dask
objects and ObjectRefs").

``to_delayed(ref)`` is a ``dask.delayed`` value whose Dask task reads the ref's value;
``from_numpy_refs`` and ``from_pandas_refs`` build a ``dask.array`` / ``dask.dataframe`` with
one block or partition per ref (Ray Data's names for the same inputs).  A Dask task on a
node that has the value in its store maps it from there: a NumPy array (and each numeric
column of a DataFrame) is a read-only view of the store's shared memory, not a copy.

The other direction needs nothing from here: a ``distributed.Future`` or a ``dask.delayed``
value may be passed to a yr or Ray task or method, and ``get``/``wait`` take them.

``dask.array`` and ``dask.dataframe`` are imported at the first call that needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from yrdask.errors import YRTypeError, YRValueError
from yrdask.runtime.context import current_runtime
from yrdask.runtime.dask_objects import dask_client
from yrdask.runtime.objects import ObjectRef, check_live
from yrdask.serialization import dumps, loads

if TYPE_CHECKING:
    import dask.array
    import dask.dataframe
    import distributed
    from dask.delayed import Delayed

__all__ = ["get_client", "to_delayed", "from_numpy_refs", "from_pandas_refs"]


def get_client() -> "distributed.Client":
    """The Dask ``Client`` of the cluster this yr runtime runs on (made the default client,
    so ``.compute()`` runs there).  The default client if it is of this cluster; in a task,
    its worker's client; in a driver, one client opened at the first call (one connection
    to the scheduler) and closed by ``yr.finalize()`` / ``ray.shutdown()``."""
    return dask_client(current_runtime())


def to_delayed(ref: ObjectRef) -> "Delayed":
    """A ``dask.delayed`` value computing to ``ref``'s value (its key is ``yr-ref-<id>``).

    The ref travels pickled as bytes (the scheduler, which unpickles graphs, never loads
    it); the Dask task that loads it is a borrower of the value, and the ref is kept by its
    owner until the owner's runtime ends (a ref pickled outside yr's calls).
    """
    import dask

    _check_refs([ref], "to_delayed")
    return dask.delayed(_read_ref, pure=True)(dumps(ref), dask_key_name=f"yr-ref-{ref.id}")


def _read_ref(blob: bytes) -> Any:
    """(a Dask task) The value of the pickled ref ``blob``, read by this process's runtime."""
    rt = current_runtime()
    return rt.get([loads(blob)], -1)[0]


def from_numpy_refs(refs: ObjectRef | list[ObjectRef], *, shape: tuple | None = None,
                    dtype: Any = None) -> "dask.array.Array":
    """A ``dask.array`` joining the NumPy arrays of ``refs`` along the first axis, one block
    per ref.  ``shape`` (of every block) and ``dtype``: without both, the arrays are read
    here to learn them (mapped from this node's store when they are on it)."""
    import dask.array as da
    import numpy as np

    refs = _check_refs(refs, "from_numpy_refs")
    if shape is None or dtype is None:
        values = current_runtime().get(refs, -1)
        for i, value in enumerate(values):
            if not isinstance(value, np.ndarray):
                raise YRTypeError(f"from_numpy_refs: refs[{i}] holds a "
                                  f"{type(value).__name__}, not a numpy.ndarray")
        shapes = [v.shape for v in values]
        dtype = values[0].dtype if dtype is None else dtype
        del values
    else:
        shapes = [tuple(shape)] * len(refs)
    blocks = [da.from_delayed(to_delayed(r), shape=s, dtype=dtype)
              for r, s in zip(refs, shapes)]
    return blocks[0] if len(blocks) == 1 else da.concatenate(blocks, axis=0)


def from_pandas_refs(refs: ObjectRef | list[ObjectRef], *,
                     meta: Any = None) -> "dask.dataframe.DataFrame":
    """A ``dask.dataframe`` with one partition per ref, each a ``pandas.DataFrame`` (or
    Series).  ``meta``: an empty frame of the partitions' columns and dtypes; without it the
    first partition is read here to learn them.  Each partition is checked against it."""
    import dask.dataframe as dd
    import pandas as pd

    refs = _check_refs(refs, "from_pandas_refs")
    if meta is None:
        first = current_runtime().get(refs[:1], -1)[0]
        if not isinstance(first, (pd.DataFrame, pd.Series)):
            raise YRTypeError(f"from_pandas_refs: refs[0] holds a {type(first).__name__}, not "
                              "a pandas.DataFrame or Series")
        meta = first.iloc[:0]
    return dd.from_delayed([to_delayed(r) for r in refs], meta=meta, verify_meta=True)


def _check_refs(refs: Any, what: str) -> list[ObjectRef]:
    if isinstance(refs, ObjectRef):
        refs = [refs]
    if not isinstance(refs, (list, tuple)) or not all(isinstance(r, ObjectRef) for r in refs):
        raise YRTypeError(f"yrdask.dask.{what} takes an ObjectRef or a list of ObjectRefs, "
                          f"got {type(refs).__name__}")
    if not refs:
        raise YRValueError(f"yrdask.dask.{what}: no refs given")
    check_live(list(refs), f"yrdask.dask.{what}")
    return list(refs)
