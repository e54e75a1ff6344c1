"""``yr.resource_group``: the ResourceGroup handle (re-exported from yrdask)."""

from yrdask.api.resource_groups import ResourceGroup  # noqa: F401

__all__ = ["ResourceGroup"]
