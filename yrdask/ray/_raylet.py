"""``ray._raylet``'s public classes, for programs that import them from there (Ray's own
streaming-generator guide does: ``from ray._raylet import ObjectRefGenerator``).  Only the
classes Ray also exports as ``ray.X``; nothing else of Ray's compiled core is stood in for."""

from yrdask.api.generators import ObjectRefGenerator
from yrdask.ray.generators import DynamicObjectRefGenerator
from yrdask.runtime.objects import ObjectRef

__all__ = ["ObjectRef", "ObjectRefGenerator", "DynamicObjectRefGenerator"]
