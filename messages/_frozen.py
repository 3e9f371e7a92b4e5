"""Frozen values: mappings that cannot change and still are dicts, and a quicker
``__init__`` for the frozen, slotted dataclasses built on every call's path.

``quick_init`` replaces the ``__init__`` that ``dataclass(frozen=True, slots=True,
kw_only=True)`` generates with one that stores each field through its slot's own
descriptor. The generated one goes through ``object.__setattr__`` per field (a
global, an attribute and a generic lookup each: the frozen class's own
``__setattr__`` refuses): 3.9 us for a ``Completed`` against 1.4 us, and a call
builds several such records. The class stays what it was: the same fields,
defaults, default factories and ``__post_init__``, still frozen, still equal,
hashed and pickled as before; only construction is quicker.

What must hold: an instance built by the quick ``__init__`` equals, field for field,
the one the dataclass's own would have built from the same arguments, and the same
arguments are refused (missing, unknown, positional). A class it cannot treat so
(not frozen and slotted, a positional field, an ``InitVar``, a field with
``init=False``) is refused when decorated, never half-handled.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

__all__ = ["FrozenMap", "quick_init"]

T = TypeVar("T")


class FrozenMap(dict[Any, Any]):
    """A dict that cannot change after it is built: a stats snapshot's mappings, a
    request's options and content parts, shared by everyone who holds them. Still a
    dict for ``json.dumps`` and ``dataclasses.asdict``; copies (``copy``, ``pickle``)
    are frozen too."""

    def _frozen(self, *_: object, **__: object) -> Any:
        raise TypeError("this mapping does not change; build a dict from it to edit")

    __setitem__ = __delitem__ = _frozen
    clear = pop = popitem = setdefault = update = __ior__ = _frozen

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (dict(self),))


_NO_VALUE = object()
"""A field with a default factory was not given (the factory makes its value)."""


def quick_init(cls: type[T]) -> type[T]:
    """``cls`` with a quicker ``__init__`` (see the module); apply it above
    ``@dataclass(frozen=True, slots=True, kw_only=True)``. ``TypeError`` names what
    keeps a class from it."""
    fields = _fields_of(cls)
    env: dict[str, Any] = {"_NO_VALUE": _NO_VALUE}
    params, body = [], []
    for i, f in enumerate(fields):
        env[f"_set{i}"] = _slot_of(cls, f.name).__set__
        if f.default is not dataclasses.MISSING:
            env[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
            body.append(f"    _set{i}(self, {f.name})")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory{i}"] = f.default_factory
            params.append(f"{f.name}=_NO_VALUE")
            value = f"_factory{i}() if {f.name} is _NO_VALUE else {f.name}"
            body.append(f"    _set{i}(self, {value})")
        else:
            params.append(f.name)
            body.append(f"    _set{i}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    star = "*, " if params else ""
    source = f"def __init__(self, {star}{', '.join(params)}):\n" + "\n".join(body or ["    pass"])
    exec(source, env)  # noqa: S102 - generated from the class's own fields, as dataclasses does
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def _fields_of(cls: type[Any]) -> tuple[dataclasses.Field[Any], ...]:
    """The fields ``quick_init`` sets, once it has checked it can treat ``cls``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"quick_init: {cls.__name__} is not a dataclass")
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    if not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"quick_init: {cls.__name__} is not frozen and slotted")
    fields = dataclasses.fields(cls)
    for f in fields:
        if not f.init:
            raise TypeError(f"quick_init: {cls.__name__}.{f.name} has init=False")
        if not f.kw_only:
            raise TypeError(f"quick_init: {cls.__name__}.{f.name} is not keyword-only")
    wanted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    if wanted != [f.name for f in fields]:  # an InitVar is a parameter but no field
        raise TypeError(f"quick_init: {cls.__name__}'s __init__ takes more than its fields")
    return fields


def _slot_of(cls: type[Any], name: str) -> Any:
    for klass in cls.__mro__:
        slot = klass.__dict__.get(name)
        if slot is not None and hasattr(slot, "__set__"):
            return slot
    raise TypeError(f"quick_init: {cls.__name__}.{name} has no slot")  # pragma: no cover
