"""Ray's generator returns over yrdask's: ``num_returns="streaming"`` (the default for a
generator function) gives yrdask's ``ObjectRefGenerator``, an iterator and async iterator of
ObjectRefs; ``num_returns="dynamic"`` an ObjectRef whose value is a
:class:`DynamicObjectRefGenerator` (the task stores each yielded value and returns their refs).
"""

from __future__ import annotations

from typing import Iterator


class DynamicObjectRefGenerator:
    """The value of a ``num_returns="dynamic"`` task: iterate it for the ObjectRefs."""

    def __init__(self, refs: list) -> None:
        self._refs = list(refs)

    def __iter__(self) -> Iterator:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)
