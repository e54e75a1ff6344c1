"""``yr.decorator``: :mod:`yrdask.decorator` at openYuanrong's path."""

from yr.decorator import function_proxy, instance_proxy  # noqa: F401

__all__ = ["function_proxy", "instance_proxy"]
