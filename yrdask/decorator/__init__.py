"""``yrdask.decorator`` (``yr.decorator``): the proxy classes behind ``@yr.invoke`` and
``@yr.instance``, at openYuanrong's module path (its examples annotate with
``yr.decorator.instance_proxy.InstanceProxy``)."""

from yrdask.decorator import function_proxy, instance_proxy  # noqa: F401

__all__ = ["function_proxy", "instance_proxy"]
