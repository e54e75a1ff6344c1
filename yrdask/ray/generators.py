"""Ray's generator returns over yrdask's: ``num_returns="streaming"`` (the default for a
generator function) gives yrdask's ``ObjectRefGenerator``, an iterator and async iterator of
ObjectRefs; ``num_returns="dynamic"`` an ObjectRef whose value is a
:class:`DynamicObjectRefGenerator` (the task stores each yielded value and returns their refs).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable, Iterator

logger = logging.getLogger("yrdask.ray")


class DynamicObjectRefGenerator:
    """The value of a ``num_returns="dynamic"`` task: iterate it for the ObjectRefs.  As on
    Ray, iterating hands each ref out once and lets go of it: a value the loop is done with
    is freed while the loop goes on, and a second loop finds only the refs not taken yet."""

    def __init__(self, refs: Iterable) -> None:
        self._refs = collections.deque(refs)

    def __iter__(self) -> Iterator:
        refs = self._refs
        while refs:
            yield refs.popleft()

    def __len__(self) -> int:
        return len(self._refs)


class DynamicReturns:
    """A generator task called with ``num_returns="dynamic"``: the call streams its items
    like any generator call (the caller owns them, and runs the task again to rebuild those
    lost with their worker), and ``invoke`` returns a ref whose value, once the generator
    ended, is a :class:`DynamicObjectRefGenerator` of them (Ray's)."""

    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        from yrdask.runtime.generators import ref_of_items

        return ref_of_items(self._proxy.invoke(*args, **kwargs), DynamicObjectRefGenerator)

    def options(self, invoke_options: Any) -> "DynamicReturns":
        return DynamicReturns(self._proxy.options(invoke_options))


def generator_returns(gen: Any, n: int,
                      reraise: Callable[[Exception], bool] | None = None) -> Any:
    """The task's ``n`` returns from the values generator ``gen`` yields (Ray's rule for a
    generator called with an int ``num_returns``): fewer values is the task's
    ``ValueError``; more are logged as an error and dropped, as Ray does (it does not raise,
    ray-project/ray#28689), and so is an error raised once all ``n`` were yielded.  If the
    generator raises after yielding some values (and
    ``reraise`` does not want it re-raised, for a rerun), those are the first returns and
    the error is each of the rest, as on Ray."""
    from yrdask.errors import ReturnError

    values: list = []
    try:
        for value in gen:
            if len(values) == n:
                logger.error("Task returned more than num_returns=%d objects; the extra ones "
                             "are dropped", n)
                gen.close()
                break
            values.append(value)
    except Exception as e:  # noqa: BLE001 - the rest of the returns, or the task's error
        if values and len(values) == n:  # every return made: logged only, as Ray does
            logger.error("Unhandled error: Task threw exception, but all return values "
                         "already created.  This should only occur when using generator "
                         "tasks.", exc_info=True)
            return values[0] if n == 1 else tuple(values)
        if not values or (reraise is not None and reraise(e)):
            raise
        import traceback

        values.extend([ReturnError(e, traceback.format_exc())] * (n - len(values)))
    if len(values) < n:
        raise ValueError(f"Task returned {len(values)} objects, but num_returns={n}.")
    return None if n == 0 else values[0] if n == 1 else tuple(values)


async def async_generator_returns(agen: Any, n: Any) -> Any:
    """:func:`generator_returns` (or :func:`dynamic_refs`) of an async generator: what it
    yields, then what it raises, replayed to them (so an error after some values is the
    rest of the returns, as for a sync generator)."""
    values: list = []
    error: Exception | None = None
    try:
        async for value in agen:
            values.append(value)
    except Exception as e:  # noqa: BLE001 - replayed after the values
        error = e

    def replay() -> Iterator:
        yield from values
        if error is not None:
            raise error

    if n == "dynamic":
        return dynamic_refs(replay(), "")
    return generator_returns(replay(), n)


def dynamic_refs(gen: Any, qualname: str, reraise: Callable[[Exception], bool] | None = None
                 ) -> DynamicObjectRefGenerator:
    """``num_returns="dynamic"``: each yielded value stored here, their refs returned.  If
    the generator raises (and ``reraise`` does not want it re-raised, for a rerun), Ray's
    rule: the refs yielded so far and then one ref that holds the error."""
    from yrdask.ray._session import failed_ref, store
    from yrdask.ray.exceptions import RayTaskError

    refs = []
    try:
        for value in gen:
            refs.append(store(value))
    except Exception as e:  # noqa: BLE001 - becomes the last ref, or a rerun
        if reraise is not None and reraise(e):
            raise
        import traceback

        text = traceback.format_exc()
        # The error ref keeps the error: not its live traceback, whose frames (this one
        # included) hold the refs yielded so far, so they and their values were never freed.
        e.__traceback__ = None
        refs.append(failed_ref(RayTaskError(qualname, text, e).as_instanceof_cause()))
    return DynamicObjectRefGenerator(refs)
