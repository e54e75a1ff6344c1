"""``yrdask.decorator.instance_proxy`` (``yr.decorator.instance_proxy``): instance handles and
creators, the same objects as the top level."""

from yrdask.api.instances import (InstanceCreator, InstanceProxy, MethodProxy,  # noqa: F401
                                  get_instance)

__all__ = ["InstanceCreator", "InstanceProxy", "MethodProxy", "get_instance"]
