"""A helper module of ray_program.py that says ``import ray`` at the top, as user modules do.

Workers import it by name when they unpickle a function defined here, so ``import ray``
must resolve there too (``python -m yrdask.ray`` carries the alias to them).
"""

import ray


def doubled_via_object_store(x):
    return ray.get(ray.put(x)) * 2


class Doubler:
    """An actor class defined in a module that imports ray (made remote by the script)."""

    def double(self, x):
        return doubled_via_object_store(x)
