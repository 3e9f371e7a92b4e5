"""A deterministic, minimal JSON value that validates against a JSON Schema.

The simulated model answers a tool call with arguments, and a ``json_schema``
response format with a text, that must validate against the schema the caller
sent; this module makes that value. Pure: a schema in, a JSON value out, no
randomness and no clock, so the same schema always gives the same value.

Theory of operation
-------------------
``instance(schema)`` walks the schema once, depth first:

* ``$ref`` (``#/$defs/X``, ``#/definitions/X`` or any JSON pointer into the
  root) is resolved against the root schema; ``allOf`` branches are merged
  into one schema; ``anyOf``/``oneOf`` take their first branch that is not
  ``null`` and does not lead back into a ``$ref`` being expanded (the first, if
  none is such);
* ``const`` gives its value, ``enum`` its first value;
* ``type`` (a list takes its first non-null entry; absent, it is guessed from
  ``properties``/``items``) picks the generator: an object gets its
  ``required`` properties (more, in declaration order, up to
  ``minProperties``); an array ``max(minItems, 1)`` items (never above
  ``maxItems``; ``minItems`` only when its items lead back into a ``$ref``
  being expanded, so a recursive tree ends in leaves), ``prefixItems`` first;
  a string ``"example"`` or the value its ``format`` names, padded or cut to
  ``minLength``/``maxLength``; a number
  the value nearest 0 inside its bounds and ``multipleOf``; a boolean
  ``false``; ``null`` ``None``.

What must hold: for every schema it accepts, the value validates against it
(``pattern`` excepted: a regular expression is not inverted, the value is the
plain string); a schema it cannot satisfy or read (not an object, a ``$ref``
that points nowhere, bounds that cross, recursion deeper than `MAX_DEPTH`) is
a ``SchemaError`` naming where in the schema, never a value that would not
validate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_DEPTH", "SchemaError", "instance"]

MAX_DEPTH = 32
"""How deep the walk goes (nesting and ``$ref`` hops) before the schema is refused."""

_FORMATS: Mapping[str, str] = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "duration": "P1D",
    "email": "user@example.com",
    "idn-email": "user@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uri": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
}
_TEXT = "example"


class SchemaError(ValueError):
    """A schema the generator cannot read or satisfy; `where` is its JSON pointer."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where or '/'}: {problem}")
        self.where = where or "/"


def instance(schema: Mapping[str, Any]) -> Any:
    """The minimal value that validates against ``schema`` (see the module docstring)."""
    if not isinstance(schema, Mapping):
        raise SchemaError("", "a schema must be an object")
    return _Walk(schema).value(schema, "", 0, 0)


class _Walk:
    __slots__ = ("active", "root")

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.active: list[str] = []
        """The ``$ref``s being expanded, outermost first: one met again is a recursion."""

    def value(self, schema: Any, where: str, depth: int, variant: int) -> Any:
        if depth > MAX_DEPTH:
            raise SchemaError(where, f"nested deeper than {MAX_DEPTH} (a recursive $ref?)")
        if schema is True or schema == {}:
            return None
        if not isinstance(schema, Mapping):
            raise SchemaError(where, "a schema must be an object")
        entered = len(self.active)
        try:
            return self._value(self._flatten(schema, where, depth), where, depth, variant)
        finally:
            del self.active[entered:]

    def _value(self, schema: Mapping[str, Any], where: str, depth: int, variant: int) -> Any:  # noqa: PLR0911 - one per kind
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            options = schema["enum"]
            if not isinstance(options, Sequence) or isinstance(options, str) or not options:
                raise SchemaError(f"{where}/enum", "must be a non-empty list")
            return options[variant % len(options)]
        kind = _kind(schema, where)
        if kind == "object":
            return self._object(schema, where, depth)
        if kind == "array":
            return self._array(schema, where, depth)
        if kind == "string":
            return _string(schema, where, variant)
        if kind in ("integer", "number"):
            return _number(schema, where, kind == "integer", variant)
        if kind == "boolean":
            return variant % 2 == 1
        return None

    def _flatten(self, schema: Mapping[str, Any], where: str, depth: int) -> Mapping[str, Any]:
        """``schema`` with its ``$ref``, ``allOf`` and first ``anyOf``/``oneOf`` folded in."""
        hops = 0
        while True:
            if "$ref" in schema:
                hops += 1
                if depth + hops > MAX_DEPTH:
                    raise SchemaError(where, f"$ref chain deeper than {MAX_DEPTH}")
                target = self._resolve(schema["$ref"], where)
                self.active.append(schema["$ref"])
                schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
                continue
            if "allOf" in schema:
                merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
                for i, branch in enumerate(_branches(schema["allOf"], f"{where}/allOf")):
                    flat = self._flatten(branch, f"{where}/allOf/{i}", depth + 1)
                    merged = _merge(merged, flat)
                schema = merged
                continue
            for key in ("anyOf", "oneOf"):
                if key in schema:
                    branches = _branches(schema[key], f"{where}/{key}")
                    pick = next((b for b in branches if self._leads_on(b)), branches[0])
                    rest = {k: v for k, v in schema.items() if k != key}
                    schema = {**rest, **pick} if isinstance(pick, Mapping) else rest
                    break
            else:
                return schema

    def _leads_on(self, branch: object) -> bool:
        """A branch worth taking: neither ``null`` nor a way back into a ``$ref`` being
        expanded (a nullable recursion ends at its ``null``)."""
        return not _is_null(branch) and not self._recursive(branch)

    def _recursive(self, schema: object) -> bool:
        return isinstance(schema, Mapping) and schema.get("$ref") in self.active

    def _resolve(self, ref: object, where: str) -> Mapping[str, Any]:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(where, f"$ref {ref!r}: only references into this schema (#/...)")
        node: Any = self.root
        for raw in ref[1:].split("/")[1:]:
            key = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise SchemaError(where, f"$ref {ref!r} points nowhere")
        if node is True:
            return {}
        if not isinstance(node, Mapping):
            raise SchemaError(where, f"$ref {ref!r} is not a schema")
        return node

    def _object(self, schema: Mapping[str, Any], where: str, depth: int) -> dict[str, Any]:
        properties = schema.get("properties") or {}
        if not isinstance(properties, Mapping):
            raise SchemaError(f"{where}/properties", "must be an object")
        required = schema.get("required") or []
        if not isinstance(required, Sequence) or isinstance(required, str):
            raise SchemaError(f"{where}/required", "must be a list of names")
        names = list(dict.fromkeys(str(n) for n in required))
        wanted = _int(schema, "minProperties", where, 0)
        for name in properties:
            if len(names) >= wanted:
                break
            if name not in names:
                names.append(name)
        if len(names) < wanted:
            raise SchemaError(where, "minProperties needs more properties than it declares")
        extra = schema.get("additionalProperties", True)
        out: dict[str, Any] = {}
        for name in names:
            at = f"{where}/properties/{name}"
            if name in properties:
                out[name] = self.value(properties[name], at, depth + 1, 0)
            elif extra is False:
                raise SchemaError(where, f"{name!r} is required but additionalProperties is false")
            else:
                out[name] = self.value(extra if extra is not True else {}, at, depth + 1, 0)
        return out

    def _array(self, schema: Mapping[str, Any], where: str, depth: int) -> list[Any]:
        low = _int(schema, "minItems", where, 0)
        high = _int(schema, "maxItems", where, None)
        if high is not None and high < low:
            raise SchemaError(where, f"minItems {low} > maxItems {high}")
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", {})
        wanted = 0 if self._recursive(items) and not prefix else 1  # a tree ends in a leaf
        count = max(low, wanted) if high is None else min(max(low, wanted), high)
        if items is False:
            count = min(count, len(prefix))
        unique = bool(schema.get("uniqueItems"))
        out = []
        for i in range(count):
            item = prefix[i] if i < len(prefix) else items
            out.append(self.value(item, f"{where}/items/{i}", depth + 1, i if unique else 0))
        if unique and len({repr(v) for v in out}) < len(out):
            raise SchemaError(where, "uniqueItems cannot be met by the item schema")
        return out


def _kind(schema: Mapping[str, Any], where: str) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if kinds else "null"
    if kind is None:
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "null"
    if kind not in ("object", "array", "string", "integer", "number", "boolean", "null"):
        raise SchemaError(f"{where}/type", f"unknown type {kind!r}")
    return str(kind)


def _string(schema: Mapping[str, Any], where: str, variant: int) -> str:
    fmt = schema.get("format")
    text = _FORMATS.get(fmt, _TEXT) if isinstance(fmt, str) else _TEXT
    if variant:
        text = f"{text}{variant}"
    low = _int(schema, "minLength", where, 0)
    high = _int(schema, "maxLength", where, None)
    if high is not None and high < low:
        raise SchemaError(where, f"minLength {low} > maxLength {high}")
    if len(text) < low:
        text += "x" * (low - len(text))
    if high is not None and len(text) > high:
        text = text[:high]
    return text


def _number(schema: Mapping[str, Any], where: str, integer: bool, variant: int) -> int | float:
    low, high = _bounds(schema, where, integer)
    step = schema.get("multipleOf")
    if step is not None and not (_real(step) and step > 0):
        raise SchemaError(f"{where}/multipleOf", "must be a number > 0")
    nearest_zero = low if low > 0 else min(0, high)
    value: float = nearest_zero
    if step is not None:
        k = math.ceil(nearest_zero / step - 1e-9)
        for _ in range(64):  # an integer multiple of a fractional step: a few tries
            value = k * step
            if not integer or float(value).is_integer():
                break
            k += 1
    value += variant * (step if step is not None else 1)
    if not low <= value <= high or (integer and not float(value).is_integer()):
        raise SchemaError(where, "no number meets its bounds and multipleOf")
    return int(value) if integer else float(value)


def _bounds(schema: Mapping[str, Any], where: str, integer: bool) -> tuple[float, float]:
    """The inclusive (low, high) the number must lie in."""
    low, high = -math.inf, math.inf
    tiny = 1 if integer else 1e-9
    for key, lower, exclusive in (
        ("minimum", True, schema.get("exclusiveMinimum") is True),  # draft 4's flag
        ("exclusiveMinimum", True, True),
        ("maximum", False, schema.get("exclusiveMaximum") is True),
        ("exclusiveMaximum", False, True),
    ):
        bound = schema.get(key)
        if bound is None or isinstance(bound, bool):
            continue
        if not _real(bound):
            raise SchemaError(f"{where}/{key}", "must be a number")
        edge = float(bound) + (tiny if exclusive else 0) * (1 if lower else -1)
        if lower:
            low = max(low, math.ceil(edge) if integer else edge)
        else:
            high = min(high, math.floor(edge) if integer else edge)
    if low > high:
        raise SchemaError(where, "its minimum is above its maximum")
    return low, high


def _int(schema: Mapping[str, Any], key: str, where: str, default: int | None) -> Any:
    value = schema.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{where}/{key}", "must be an integer >= 0")
    return value


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _branches(value: object, where: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise SchemaError(where, "must be a non-empty list of schemas")
    return value


def _is_null(schema: object) -> bool:
    return isinstance(schema, Mapping) and schema.get("type") == "null"


def _merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two ``allOf`` branches as one schema: properties and required united."""
    out = {**a, **b}
    if "properties" in a and "properties" in b:
        out["properties"] = {**a["properties"], **b["properties"]}
    if "required" in a and "required" in b:
        out["required"] = [*a["required"], *b["required"]]
    return out
