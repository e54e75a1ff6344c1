"""Checking call arguments against a signature at ``invoke`` time, cheaply.

``Signature.bind`` costs several microseconds per call, a visible share of a submitting
thread's time.  Most calls pass positional arguments only, to a signature of plain
parameters: for those, counting the arguments is the same check.  Anything else is bound.
"""

from __future__ import annotations

import functools
import inspect

_PLAIN = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@functools.lru_cache(maxsize=4096)
def _positional_range(sig: inspect.Signature) -> tuple[int, int] | None:
    """(fewest, most) positional arguments if every parameter is plain, else None."""
    params = list(sig.parameters.values())
    if any(p.kind not in _PLAIN for p in params):
        return None
    required = sum(1 for p in params if p.default is inspect.Parameter.empty)
    return required, len(params)


#: id(signature) -> (signature, span): hashing a Signature walks its parameters, so the
#: per-call lookup goes by identity (the signature is kept, so its id is never reused)
_spans: dict[int, tuple[inspect.Signature, tuple[int, int] | None]] = {}


def check_call(sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """Raise ``TypeError`` (as ``sig.bind`` would) if ``args, kwargs`` do not fit ``sig``."""
    if not kwargs:
        hit = _spans.get(id(sig))
        if hit is not None and hit[0] is sig:
            span = hit[1]
        else:
            try:
                span = _positional_range(sig)
            except TypeError:  # an unhashable default: no cache
                span = None
            if len(_spans) >= 4096:
                _spans.clear()
            _spans[id(sig)] = (sig, span)
        if span is not None and span[0] <= len(args) <= span[1]:
            return
    sig.bind(*args, **kwargs)
