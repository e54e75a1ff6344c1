"""``yr.config``: the option and configuration classes (re-exported from yrdask, same objects)."""

from yrdask.options import Config, InvokeOptions, ResourceGroupOptions  # noqa: F401
from yrdask.runtime.driver import ClientInfo  # noqa: F401

__all__ = ["ClientInfo", "Config", "InvokeOptions", "ResourceGroupOptions"]
