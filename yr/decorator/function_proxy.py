"""``yr.decorator.function_proxy``: :mod:`yrdask.decorator.function_proxy` (same objects)."""

from yrdask.decorator.function_proxy import *  # noqa: F401,F403
from yrdask.decorator.function_proxy import __all__  # noqa: F401
