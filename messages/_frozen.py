"""Frozen JSON values: mappings that cannot change and still are dicts."""

from __future__ import annotations

from typing import Any

__all__ = ["FrozenMap"]


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
