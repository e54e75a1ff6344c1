"""``yr.exception``: every error class yrdask raises (re-exported from yrdask.errors).

``CancelError`` is yr's name for :class:`yrdask.errors.CancelledError` (the same class).
"""

from yrdask.errors import *  # noqa: F401,F403
from yrdask.errors import CancelledError
from yrdask.errors import __all__ as _errors

CancelError = CancelledError

__all__ = sorted({*_errors, "CancelError"})
