"""``yr.decorator``: the proxy classes behind ``@yr.invoke`` and ``@yr.instance``."""
