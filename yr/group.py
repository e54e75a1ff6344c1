"""``yr.group``: gang creation of instances (re-exported from yrdask)."""

from yrdask.api.group import Group, GroupOptions  # noqa: F401

__all__ = ["Group", "GroupOptions"]
