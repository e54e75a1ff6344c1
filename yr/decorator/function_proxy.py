"""``yr.decorator.function_proxy``: the stateless function proxy (re-exported from yrdask)."""

from yrdask.api.functions import FunctionProxy  # noqa: F401

__all__ = ["FunctionProxy"]
