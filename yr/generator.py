"""``yr.generator``: what ``.invoke()`` of a generator returns (re-exported from yrdask)."""

from yrdask.api.generators import ObjectRefGenerator  # noqa: F401

__all__ = ["ObjectRefGenerator"]
