"""The minimal instance of a JSON Schema (provider/instances.py). Schemas come from
pydantic models, whose own validation then judges the instance, and from hand-written
schemas for what pydantic does not emit."""

from __future__ import annotations

import datetime
import enum
import uuid
from typing import Annotated, Any, Literal

import pytest
from callboard.provider.instances import MAX_DEPTH, SchemaError, instance
from pydantic import AnyUrl, BaseModel, ConfigDict, Field, TypeAdapter


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(BaseModel):
    x: float
    y: Annotated[int, Field(ge=3, le=9, multiple_of=3)]


class Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=12, max_length=20)]
    colour: Colour
    kind: Literal["circle", "square"]
    points: Annotated[list[Point], Field(min_length=2)]
    tags: Annotated[set[str], Field(min_length=3)]
    label: str | None
    scale: Annotated[float, Field(gt=0.5, lt=1.0)]
    level: Annotated[int, Field(lt=-4)]
    created: datetime.datetime
    ident: uuid.UUID
    note: str = "optional, so left out"


class Tree(BaseModel):
    value: int
    children: list[Tree]


class Pet(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Owner(BaseModel):
    pet: Pet | Dog
    homepage: AnyUrl | None
    scores: dict[str, int]
    pair: tuple[int, str]


@pytest.mark.parametrize("model", [Point, Shape, Tree, Owner])
def test_a_pydantic_models_schema_gives_an_instance_the_model_accepts(
    model: type[BaseModel],
) -> None:
    schema = model.model_json_schema()
    value = instance(schema)
    model.model_validate(value)  # raises if not valid
    assert instance(schema) == value  # deterministic


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (int, 0),
        (bool, False),
        (str, "example"),
        (Annotated[int, Field(gt=7)], 8),
        (Annotated[float, Field(ge=-2.5, le=-1.0)], -1.0),
        (Annotated[str, Field(min_length=10)], "examplexxx"),
        (Annotated[str, Field(max_length=3)], "exa"),
        (list[int], [0]),
        (Annotated[list[int], Field(max_length=0)], []),
        (Literal[5], 5),
        (datetime.date, "2026-01-01"),
    ],
)
def test_the_instance_is_the_simplest_value(kind: Any, expected: Any) -> None:
    adapter: TypeAdapter[Any] = TypeAdapter(kind)
    value = instance(adapter.json_schema())
    assert value == expected
    adapter.validate_python(value)


def test_only_required_properties_are_filled_unless_min_properties_asks_more() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["b"],
    }
    assert instance(schema) == {"b": 0}
    assert instance({**schema, "minProperties": 2}) == {"b": 0, "a": "example"}


def test_unique_items_are_distinct() -> None:
    value = instance(
        {"type": "array", "items": {"type": "integer"}, "minItems": 3, "uniqueItems": True}
    )
    assert value == [0, 1, 2]
    enum_value = instance(
        {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "uniqueItems": True}
    )
    assert enum_value == ["a", "b"]


def test_refs_all_of_and_nullable_unions_are_followed() -> None:
    schema = {
        "$defs": {"Id": {"type": "string", "format": "uuid"}},
        "allOf": [
            {"type": "object", "properties": {"id": {"$ref": "#/$defs/Id"}}, "required": ["id"]},
            {"properties": {"n": {"type": ["null", "integer"], "minimum": 2}}, "required": ["n"]},
        ],
    }
    assert instance(schema) == {"id": "00000000-0000-4000-8000-000000000000", "n": 2}
    assert instance({"anyOf": [{"type": "null"}, {"const": "x"}]}) == "x"
    assert instance({"oneOf": [{"type": "null"}]}) is None


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "integer", "minimum": 5, "maximum": 1}, "/"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "minLength": 4, "maxLength": 2}},
                "required": ["a"],
            },
            "/properties/a",
        ),
        ({"$ref": "#/$defs/missing"}, "/"),
        ({"type": "integer", "multipleOf": 0.4, "minimum": 0.1, "maximum": 0.3}, "/"),
        ({"type": "spaceship"}, "/type"),
        ({"enum": []}, "/enum"),
        ({"type": "object", "required": ["a"], "additionalProperties": False}, "/"),
    ],
)
def test_what_cannot_be_satisfied_is_a_schema_error_saying_where(
    schema: dict[str, Any], where: str
) -> None:
    with pytest.raises(SchemaError) as refused:
        instance(schema)
    assert refused.value.where == where


def test_a_recursion_without_a_way_out_is_refused_not_followed_forever() -> None:
    schema = {
        "$defs": {
            "Loop": {
                "type": "object",
                "properties": {"next": {"$ref": "#/$defs/Loop"}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/Loop",
    }
    with pytest.raises(SchemaError, match=str(MAX_DEPTH)):
        instance(schema)
    with pytest.raises(SchemaError, match="ref"):
        instance({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"})
