"""``ObjectRefGenerator``: what ``.invoke()`` of a generator function or method returns.

See ``docs/generators.md`` for the semantics; the owner-side stream it reads is
:class:`yrdask.runtime.generators.Stream`.
"""

from __future__ import annotations

from typing import Any

from yrdask.errors import YRTypeError
from yrdask.runtime.objects import ObjectRef


class ObjectRefGenerator:
    """The refs of the values a remote generator yields, in order, as they are produced.

    An iterator and an async iterator of ``ObjectRef`` s::

        gen = numbers.invoke(3)
        first = next(gen)           # waits until the first value exists
        for ref in gen:             # resumes after `first`
            print(yr.get(ref))
        async for ref in gen2:      # in async code
            print(await ref)

    If the generator raises while producing item k, the k-th ref raises that error at
    ``yr.get`` and the iteration then ends.  A worker that dies mid-stream fails the next
    ref the same way, with the crash error.  Built by ``.invoke()`` only; it reads a stream
    its process owns, so it cannot be pickled (pass the refs it yields instead).
    ``yrdask.ray`` returns the same class for ``num_returns="streaming"``.
    """

    __slots__ = ("_stream", "__weakref__")

    def __init__(self, stream: Any) -> None:
        """Only ``.invoke()`` builds generators (``stream``: the runtime's stream)."""
        self._stream = stream

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> "ObjectRefGenerator":
        return self

    def __next__(self) -> ObjectRef:
        ref = self._stream.next()
        if ref is None:
            raise StopIteration
        return ref

    def next(self, timeout: float | None = None) -> ObjectRef:
        """The next ref, waiting at most ``timeout`` seconds (``None``: no limit).

        Raises ``StopIteration`` at the end and ``yr.YRTimeoutError`` if nothing came in time
        (the generator is left as it was: call again to keep waiting).
        """
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout < 0):
            raise YRTypeError(f"ObjectRefGenerator.next: timeout must be a number of seconds "
                              f">= 0 or None, got {timeout!r}")
        ref = self._stream.next(timeout)
        if ref is None:
            raise StopIteration
        return ref

    def __aiter__(self) -> "ObjectRefGenerator":
        return self

    async def __anext__(self) -> ObjectRef:
        ref = await self._stream.anext()
        if ref is None:
            raise StopAsyncIteration
        return ref

    # -- the call ----------------------------------------------------------------------------

    @property
    def task_id(self) -> str:
        """The id of the generator call; item refs are ``<task_id>.<index>``."""
        return self._stream.call_id

    def completed(self) -> ObjectRef:
        """A ref that is ready when the generator has finished: its value is the number of
        items, and it raises the generator's error if it failed."""
        return self._stream.end_ref

    def is_finished(self) -> bool:
        """True once iterating would stop at once (every item and any error taken)."""
        return self._stream.finished()

    def cancel(self) -> None:
        """Cancel the generator task (as ``yr.cancel`` does a task): the next ref raises
        ``yr.CancelledError``.  A no-op for a generator method of an instance."""
        self._stream.cancel()

    def story(self) -> str:
        """What the owner did with this stream's items, as text (for debugging)."""
        return self._stream.story()

    def __repr__(self) -> str:
        return f"ObjectRefGenerator({self._stream.what}, {self._stream.call_id})"

    def __reduce__(self):
        raise YRTypeError(
            f"{self!r} cannot be pickled or passed to another task: it reads a stream owned "
            "by this process. Pass the ObjectRefs it yields instead, e.g. "
            "f.invoke(list(gen)) or f.invoke([next(gen)])")

    def __del__(self) -> None:
        try:
            self._stream.abandon()
        except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone
            pass
