"""``yr.decorator.instance_proxy``: instance handles and creators (re-exported from yrdask)."""

from yrdask.api.instances import (InstanceCreator, InstanceProxy, MethodProxy,  # noqa: F401
                                  get_instance)

__all__ = ["InstanceCreator", "InstanceProxy", "MethodProxy", "get_instance"]
