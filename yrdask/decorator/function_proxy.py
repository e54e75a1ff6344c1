"""``yrdask.decorator.function_proxy`` (``yr.decorator.function_proxy``): the stateless
function proxy, the same object as the top level."""

from yrdask.api.functions import FunctionProxy  # noqa: F401

__all__ = ["FunctionProxy"]
