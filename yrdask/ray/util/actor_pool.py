"""``ray.util.ActorPool``: spread calls over a fixed set of actors, one call per actor at a time."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

__all__ = ["ActorPool"]


def _key(ref: Any) -> Any:
    """A submission's key: its ref, or the tuple of its refs (``num_returns`` > 1)."""
    return tuple(ref) if isinstance(ref, list) else ref


def _refs(key: Any) -> list:
    return list(key) if isinstance(key, tuple) else [key]


class ActorPool:
    """Run ``fn(actor, value)`` calls on idle actors of ``actors``; results by order or as they
    finish.  ``fn`` must return the ObjectRef of one actor method call."""

    def __init__(self, actors: list) -> None:
        from yrdask.ray.actor import ActorHandle

        actors = list(actors)
        for a in actors:
            if not isinstance(a, ActorHandle):
                raise TypeError(f"ActorPool takes actor handles, got {type(a).__name__}")
        self._idle_actors = actors
        self._future_to_actor: dict = {}  # ref -> (submit index, actor)
        self._index_to_future: dict = {}  # submit index -> ref
        self._next_task_index = 0
        self._next_return_index = 0
        self._pending_submits: list = []  # (fn, value) waiting for an idle actor

    def map(self, fn: Callable, values: Iterable) -> Iterator:
        """Results of ``fn`` over ``values``, in the order of ``values``."""
        return self._map(fn, values, ordered=True)

    def map_unordered(self, fn: Callable, values: Iterable) -> Iterator:
        """Results of ``fn`` over ``values``, as they finish."""
        return self._map(fn, values, ordered=False)

    def _map(self, fn: Callable, values: Iterable, ordered: bool) -> Iterator:
        """Drop what earlier submits left unread (as Ray does), submit all, then yield.

        ``map`` drops them at once; ``map_unordered`` lets them finish first and drops their
        results (Ray polls for them; waiting for the next one is the same without spinning).
        """
        while self.has_next():
            try:
                if ordered:
                    self.get_next(timeout=0, ignore_if_timedout=True)
                else:
                    self.get_next_unordered()
            except TimeoutError:
                pass
        for v in values:
            self.submit(fn, v)

        def results() -> Iterator:
            while self.has_next():
                yield self.get_next() if ordered else self.get_next_unordered()
        return results()

    def submit(self, fn: Callable, value: Any) -> None:
        """Run ``fn(actor, value)`` on an idle actor now, or when one becomes idle."""
        if self._idle_actors:
            actor = self._idle_actors.pop()
            ref = fn(actor, value)  # a ref, or a list of them (num_returns > 1)
            self._future_to_actor[_key(ref)] = (self._next_task_index, actor)
            self._index_to_future[self._next_task_index] = ref
            self._next_task_index += 1
        else:
            self._pending_submits.append((fn, value))

    def has_next(self) -> bool:
        """Whether results are still to be returned."""
        return bool(self._future_to_actor) or bool(self._pending_submits)

    def get_next(self, timeout: float | None = None, ignore_if_timedout: bool = False) -> Any:
        """The next result in submission order; ``TimeoutError`` after ``timeout`` s (with
        ``ignore_if_timedout``, that task is dropped first, as on Ray)."""
        from yrdask.ray.worker import wait

        if not self.has_next():
            raise StopIteration("No more results to get")
        if self._next_return_index >= self._next_task_index:
            raise ValueError("It is not allowed to call get_next() after get_next_unordered().")
        ref = self._index_to_future[self._next_return_index]
        ignored = False
        if timeout is not None:
            refs = _refs(_key(ref))
            ready, _ = wait(refs, num_returns=len(refs), timeout=timeout)
            if len(ready) < len(refs):
                if not ignore_if_timedout:
                    raise TimeoutError("Timed out waiting for result")
                ignored = True
        del self._index_to_future[self._next_return_index]
        self._next_return_index += 1
        _, actor = self._future_to_actor.pop(_key(ref))
        if ignored:  # Ray: the task is dropped, and the caller told so
            self._return_actor(actor)
            raise TimeoutError(f"Timed out waiting for result. The task {ref} has been "
                               "ignored.")
        return self._result(ref, actor)

    def get_next_unordered(self, timeout: float | None = None,
                           ignore_if_timedout: bool = False) -> Any:
        """The next result to finish; ``TimeoutError`` after ``timeout`` s (with
        ``ignore_if_timedout``, the first pending task is dropped first, as on Ray)."""
        from yrdask.ray.worker import wait

        if not self.has_next():
            raise StopIteration("No more results to get")
        heads = {_refs(key)[0]: key for key in self._future_to_actor}
        ready, _ = wait(list(heads), num_returns=1, timeout=timeout)
        if not ready:
            if not ignore_if_timedout:
                raise TimeoutError("Timed out waiting for result")
            key = next(iter(self._future_to_actor))  # Ray: the first pending one is dropped
            index, actor = self._future_to_actor.pop(key)
            self._index_to_future.pop(index, None)
            self._next_return_index = max(self._next_return_index, index + 1)
            self._return_actor(actor)
            raise TimeoutError(f"Timed out waiting for result. The task {key} has been "
                               "ignored.")
        key = heads[ready[0]]
        index, actor = self._future_to_actor.pop(key)
        ref = self._index_to_future.pop(index, key)
        self._next_return_index = max(self._next_return_index, index + 1)
        return self._result(ref, actor)

    def _result(self, ref: Any, actor: Any) -> Any:
        """The value(s) of ``ref``; the actor goes back to the pool unless it died (Ray)."""
        from yrdask.ray.exceptions import ActorDiedError
        from yrdask.ray.worker import get

        alive = True
        try:
            return get(ref)
        except ActorDiedError:
            alive = False
            raise
        finally:
            if alive:
                self._return_actor(actor)
            elif self._pending_submits and self._idle_actors:
                self.submit(*self._pending_submits.pop(0))

    def _return_actor(self, actor: Any) -> None:
        self._idle_actors.append(actor)
        if self._pending_submits:
            self.submit(*self._pending_submits.pop(0))

    def has_free(self) -> bool:
        """Whether an actor is idle (and no submit waits for one)."""
        return bool(self._idle_actors) and not self._pending_submits

    def pop_idle(self) -> Any:
        """Remove and return an idle actor, or None."""
        if self.has_free():
            return self._idle_actors.pop()
        return None

    def push(self, actor: Any) -> None:
        """Add an actor to the pool (it must not be in it already)."""
        busy = [a for _, a in self._future_to_actor.values()]
        if actor in self._idle_actors or actor in busy:
            raise ValueError("Actor already belongs to current ActorPool")
        self._return_actor(actor)
