"""Ray actors feed a Dask DataFrame, and a Dask result feeds a Ray task, on one cluster.

A pipeline of Ray-style actors (``yrdask.ray``) reads and cleans shards of sales records;
each cleaned shard is a ``pandas.DataFrame`` behind an ObjectRef.  ``yrdask.dask``
turns those refs into one ``dask.dataframe`` (a partition per ref, read by the Dask tasks
from the node's object store without a copy), whose groupby runs on the same cluster's Dask
workers.  The Dask result, a ``distributed.Future``, then goes straight into a Ray task.

Run it with ``python examples/dask_meets_ray.py``.
"""

import numpy as np
import pandas as pd

import yrdask.ray as ray
from yrdask import dask as ydask

SHARDS = 8
ROWS = 20_000
STORES = ["north", "south", "east", "west"]


def make_shard(shard: int) -> pd.DataFrame:
    """The raw records of one shard (some refunds are negative amounts)."""
    rng = np.random.default_rng(shard)
    return pd.DataFrame({
        "store": rng.choice(STORES, ROWS),
        "amount": rng.integers(-20, 100, ROWS).astype("float64"),
    })


@ray.remote
class Reader:
    def read(self, shard: int) -> pd.DataFrame:
        return make_shard(shard)


@ray.remote
class Cleaner:
    def __init__(self) -> None:
        self.dropped = 0

    def clean(self, records: pd.DataFrame) -> pd.DataFrame:
        kept = records[records["amount"] > 0]
        self.dropped += len(records) - len(kept)
        return kept.reset_index(drop=True)

    def dropped_rows(self) -> int:
        return self.dropped


@ray.remote
def best_store(totals: pd.Series) -> str:
    """A Ray task given a Dask Future: it sees the Series the Future stands for."""
    return f"{totals.idxmax()} sold most: {totals.max():.0f}"


ray.init(num_cpus=2)
client = ydask.get_client()  # the Dask client of the same cluster (the default one now)

readers = [Reader.remote() for _ in range(2)]
cleaner = Cleaner.remote()
raw = [readers[i % 2].read.remote(i) for i in range(SHARDS)]
cleaned = [cleaner.clean.remote(ref) for ref in raw]  # refs in, refs out: no driver copy

sales = ydask.from_pandas_refs(cleaned)  # one partition per ref
totals = client.compute(sales.groupby("store")["amount"].sum())  # a distributed.Future
print(ray.get(best_store.remote(totals)))

expected = pd.concat(make_shard(i) for i in range(SHARDS))
expected = expected[expected["amount"] > 0].groupby("store")["amount"].sum()
got = ray.get(totals)  # ray.get takes a Dask Future too
pd.testing.assert_series_equal(got.sort_index(), expected.sort_index())
print(f"{sales.npartitions} partitions, {ray.get(cleaner.dropped_rows.remote())} refunds "
      f"dropped; groupby checked against pandas: {len(got)} stores, {got.sum():.0f} in all")
ray.shutdown()
