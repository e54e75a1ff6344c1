"""Checked dataclass fields: one spec per field (its types, element types, a value check, or
why yrdask does not support it), and the typed errors a value that breaks its spec raises.

The option classes of ``yrdask/options.py`` declare their fields with :func:`spec_field` and
call :func:`validate_fields` and :func:`reject_unsupported` in their ``validate()``."""

from __future__ import annotations

import copy as _copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from yrdask.errors import YRTypeError, YRValueError

SPEC_KEY = "yrdask.spec"
NoneType = type(None)

# A value check gets the (already type-checked) value and returns None when it is fine, or
# the phrase that completes "<Owner>.<field> must ..." when it is not.
Check = Callable[[Any], "str | None"]


# --------------------------------------------------------------------------- field specs


@dataclass(frozen=True)
class Spec:
    """How one dataclass field is checked: allowed types, element types and a value check."""

    types: tuple[type, ...] | None  # None: any type is accepted
    expect: str  # what is expected, for messages: "an int (millicores)"
    keys: tuple[type, ...] | None = None  # dict key types
    items: tuple[type, ...] | None = None  # dict value / list element types
    check: Check | None = None
    # Set for a field yrdask does not support: (why it has no meaning here, what to use
    # instead).  A value other than the field's default is then a YRValueError naming both.
    reject: tuple[str, str] | None = None


def unsupported(spec: Spec, why: str, instead: str) -> Spec:
    """``spec`` for a field yrdask rejects when set: ``why`` it has no meaning, what to use ``instead``."""
    return dataclasses.replace(spec, reject=(why, instead))


def spec_field(
    spec: Spec, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, repr: bool = True
) -> Any:
    """A dataclass field carrying its validation spec in its metadata."""
    return field(default=default, default_factory=factory, repr=repr, metadata={SPEC_KEY: spec})


def in_range(lo: int | None, hi: int | None) -> Check:
    """A check that an int (or None, which passes) lies in [lo, hi]."""

    def check(v: Any) -> str | None:
        if v is None or ((lo is None or v >= lo) and (hi is None or v <= hi)):
            return None
        if hi is None:
            return f"be >= {lo}"
        if lo is None:
            return f"be <= {hi}"
        return f"be in [{lo}, {hi}]"

    return check


def int_spec(lo: int | None = None, hi: int | None = None, note: str = "", none_ok: bool = False) -> Spec:
    """An int in [lo, hi] (``note``: its unit, for messages; ``none_ok``: None passes)."""
    note = f" ({note})" if note else ""
    expect = f"None or an int{note}" if none_ok else f"an int{note}"
    types: tuple[type, ...] = (int, NoneType) if none_ok else (int,)
    return Spec(types, expect, check=in_range(lo, hi))


def bool_spec(none_ok: bool = False) -> Spec:
    """A bool (``none_ok``: or None)."""
    return Spec((bool, NoneType), "None or a bool") if none_ok else Spec((bool,), "a bool")


STR = Spec((str,), "a str")
ANY = Spec(None, "any value")
STR_LIST = Spec((list,), "a list[str]", items=(str,))
LIST = Spec((list,), "a list")
STR_DICT = Spec((dict,), "a dict[str, str]", keys=(str,), items=(str,))
DICT = Spec((dict,), "a dict")


# --------------------------------------------------------------------------- checking a dataclass


def is_instance_of(value: Any, types: tuple[type, ...]) -> bool:
    """isinstance, except that a bool does not count as an int or float unless bool is listed."""
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def show(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_error(owner: str, name: str, spec: Spec, value: Any, detail: str = "") -> YRTypeError:
    """The error of ``owner.name`` set to ``value``, which is not what ``spec`` expects."""
    return YRTypeError(
        f"{owner}.{name} must be {spec.expect}, got {show(value)} ({type(value).__name__}){detail}"
    )


def check_value(owner: str, name: str, spec: Spec, value: Any) -> None:
    """Raise YRTypeError / YRValueError when ``value`` does not satisfy ``spec``."""
    if spec.types is not None and not is_instance_of(value, spec.types):
        raise type_error(owner, name, spec, value)
    if isinstance(value, dict):
        for k, v in value.items():
            if spec.keys is not None and not is_instance_of(k, spec.keys):
                raise type_error(owner, name, spec, value, f": key {k!r} is a {type(k).__name__}")
            if spec.items is not None and not is_instance_of(v, spec.items):
                raise type_error(owner, name, spec, value, f": value of {k!r} is a {type(v).__name__}")
    elif isinstance(value, list) and spec.items is not None:
        for i, v in enumerate(value):
            if not is_instance_of(v, spec.items):
                raise type_error(owner, name, spec, value, f": item {i} is a {type(v).__name__}")
    if spec.check is not None:
        problem = spec.check(value)
        if problem is not None:
            # A spec without types checks the type itself (a class imported lazily).
            error = YRTypeError if spec.types is None else YRValueError
            raise error(f"{owner}.{name} must {problem}, got {show(value)}")


def validate_fields(obj: Any) -> None:
    """Check every dataclass field of ``obj`` against the spec stored in its metadata."""
    owner = type(obj).__name__
    for f in dataclasses.fields(obj):
        spec = f.metadata.get(SPEC_KEY)
        if spec is not None:
            check_value(owner, f.name, spec, getattr(obj, f.name))


def field_default(f: dataclasses.Field) -> Any:
    """The default value of dataclass field ``f`` (a fresh one for a factory)."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def rejection(f: dataclasses.Field) -> tuple[str, str] | None:
    """``(why, instead)`` when yrdask rejects field ``f`` set to a non-default value, else None."""
    spec = f.metadata.get(SPEC_KEY)
    return None if spec is None else spec.reject


def reject_unsupported(obj: Any, skip: tuple[str, ...] = ()) -> None:
    """YRValueError for the first field yrdask does not support that is set to a non-default value.

    The message names the field, why it has no meaning on Dask and what to use instead: no
    option is accepted and then ignored (docs/options.md lists every field).
    """
    owner = type(obj).__name__
    for f in dataclasses.fields(obj):
        reject = rejection(f)
        if reject is None or f.name in skip:
            continue
        value = getattr(obj, f.name)
        if value != field_default(f):
            why, instead = reject
            shown = show(value) if f.repr else "a value (hidden)"  # secrets stay out of messages
            raise YRValueError(f"{owner}.{f.name} is not supported by yrdask ({why}); {instead} "
                               f"(got {shown})")


def copy_containers(obj: Any) -> Any:
    """A shallow copy of ``obj`` whose dict/list/set fields are deep-copied (shallow if that fails)."""
    new = _copy.copy(obj)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (dict, list, set)):
            try:
                value = _copy.deepcopy(value)
            except Exception:
                value = _copy.copy(value)
            setattr(new, f.name, value)
    return new
