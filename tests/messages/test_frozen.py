"""``quick_init``: the same records as the dataclass's own ``__init__``, built quicker."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
from callboard.messages import Completed, Failed, FailureReason, FrozenMap, Usage
from callboard.messages._frozen import quick_init


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Stock:
    name: str
    tags: list[str] = dataclasses.field(default_factory=list)
    count: int = 3


@quick_init
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Quick:
    name: str
    tags: list[str] = dataclasses.field(default_factory=list)
    count: int = 3


@quick_init
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Checked:
    size: int

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError("size must be >= 0")


@quick_init
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Child(Quick):
    extra: float = 0.5


@pytest.mark.parametrize(
    "kwargs", [{"name": "a"}, {"name": "a", "count": 9}, {"name": "b", "tags": ["x"], "count": 0}]
)
def test_builds_what_the_dataclass_would(kwargs: dict[str, Any]) -> None:
    assert dataclasses.astuple(Quick(**kwargs)) == dataclasses.astuple(Stock(**kwargs))


def test_a_default_factory_makes_a_fresh_value_each_time() -> None:
    assert Quick(name="a").tags is not Quick(name="a").tags


@pytest.mark.parametrize(
    ("args", "kwargs", "said"),
    [
        (("a",), {}, "positional"),
        ((), {}, "missing 1 required keyword-only argument: 'name'"),
        ((), {"name": "a", "colour": "red"}, "unexpected keyword argument 'colour'"),
    ],
)
def test_refuses_what_the_dataclass_refuses(
    args: tuple[Any, ...], kwargs: dict[str, Any], said: str
) -> None:
    with pytest.raises(TypeError, match=said):
        Quick(*args, **kwargs)
    with pytest.raises(TypeError):
        Stock(*args, **kwargs)


def test_still_frozen_equal_hashed_and_pickled() -> None:
    q = Quick(name="a", tags=[], count=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.count = 2  # type: ignore[misc]
    assert q == Quick(name="a", tags=[], count=1)
    assert pickle.loads(pickle.dumps(q)) == q  # noqa: S301 - our own bytes
    assert hash(Usage(prompt_tokens=1)) == hash(Usage(prompt_tokens=1))


def test_post_init_still_checks() -> None:
    assert Checked(size=0).size == 0
    with pytest.raises(ValueError, match="size must be >= 0"):
        Checked(size=-1)


def test_a_subclass_sets_its_bases_fields_too() -> None:
    c = Child(name="a", extra=1.5)
    assert (c.name, c.tags, c.count, c.extra) == ("a", [], 3, 1.5)


def test_results_are_built_whole() -> None:
    done = Completed(task_id=1, trace_id="t", content="hi", usage=Usage(prompt_tokens=2))
    assert (done.task_id, done.content, done.usage.total_tokens, done.ok) == (1, "hi", 2, True)
    assert dict(done.metadata) == {}
    failed = Failed(task_id=2, trace_id="t", reason=FailureReason.TIMEOUT)
    assert (failed.detail, failed.status_code, failed.ok) == ("", None, False)


def test_refuses_a_class_it_cannot_treat() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NotSlotted:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Positional:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Hidden:
        a: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class WithInitVar:
        a: int
        scale: dataclasses.InitVar[int] = 1

    for cls, said in [
        (NotSlotted, "not frozen and slotted"),
        (Positional, "not keyword-only"),
        (Hidden, "init=False"),
        (WithInitVar, "takes more than its fields"),
        (FrozenMap, "not a dataclass"),
    ]:
        with pytest.raises(TypeError, match=said):
            quick_init(cls)
