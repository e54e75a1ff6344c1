"""``ray._raylet``'s public classes, for programs that import them from there (Ray's own
streaming-generator guide does: ``from ray._raylet import ObjectRefGenerator``).  Only the
classes Ray also exports as ``ray.X``, and ``RAY_NODE_ID_KEY``, the label every node has
(its id), which Ray's programs put in a ``label_selector``; nothing else of Ray's compiled
core is stood in for.  ``import ray`` makes it ``ray._raylet``, as on Ray."""

from yrdask.api.generators import ObjectRefGenerator
from yrdask.ray.generators import DynamicObjectRefGenerator
from yrdask.ray._options import NODE_ID_LABEL as RAY_NODE_ID_KEY
from yrdask.runtime.objects import ObjectRef

__all__ = ["ObjectRef", "ObjectRefGenerator", "DynamicObjectRefGenerator", "RAY_NODE_ID_KEY"]
