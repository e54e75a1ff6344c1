"""``yr.object_ref``: the ObjectRef class (re-exported from yrdask)."""

from yrdask.runtime.objects import ObjectRef  # noqa: F401

__all__ = ["ObjectRef"]
