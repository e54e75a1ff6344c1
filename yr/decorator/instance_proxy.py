"""``yr.decorator.instance_proxy``: :mod:`yrdask.decorator.instance_proxy` (same objects)."""

from yrdask.decorator.instance_proxy import *  # noqa: F401,F403
from yrdask.decorator.instance_proxy import __all__  # noqa: F401
