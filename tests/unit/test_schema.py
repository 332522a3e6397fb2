"""The schema checker behind every config key: which values match which annotations (a bool is
not an int, a string is not a list), ranges applied to the matching union member and to list
items (NaN refused), types described in plain English for the error line, and a constructor's
schema followed through **kwargs to its parent's signature."""

from typing import Annotated, Literal, Optional, Sequence, Union

import pytest

from trainer.infra.errors import UserError
from trainer.infra.schema import POSITIVE, Range, check_mapping, check_value, describe, matches, schema_of_callable


@pytest.mark.parametrize(
    "value, annotation, ok",
    [
        (3, int, True), (True, int, False), (3.0, int, False), (3, float, True), (True, float, False),
        ("a", str, True), (None, Optional[int], True), (None, int, False),
        ("auto", Union[int, Literal["auto"]], True), ("other", Union[int, Literal["auto"]], False),
        ([1, 2], Sequence[int], True), ([1, "x"], Sequence[int], False), ("ab", Sequence[str], False),
        ([0.9, 0.99], tuple[float, float], True), ([0.9], tuple[float, float], False),
        ({"a": 1}, dict[str, int], True), (1, Literal[True, 1], True), (True, Literal[1], False),
    ],
)
def test_matches(value, annotation, ok):
    assert matches(value, annotation) is ok


def test_ranges_apply_to_the_matching_union_member_and_to_list_items():
    warmup = Union[Annotated[int, Range(ge=0)], Annotated[float, Range(ge=0, lt=1)]]
    check_value("w", 500, warmup)  # an integer step count is not bounded by 1
    with pytest.raises(UserError, match=r"^w: 1.5 must be < 1"):
        check_value("w", 1.5, warmup)
    with pytest.raises(UserError, match=r"widths\[1\]: 0 must be >= 1"):
        check_value("widths", [8, 0], Sequence[Annotated[int, Range(ge=1)]])
    with pytest.raises(UserError, match="must be a finite number"):
        check_value("lr", float("nan"), Annotated[float, POSITIVE])


def test_describe_reads_like_english():
    assert describe(Annotated[int, Range(ge=1)]) == "an integer >= 1"
    assert describe(Union[int, Literal["auto"]]) == "an integer or one of 'auto'"
    assert describe(Optional[bool]) == "true/false or null"


class Base:
    def __init__(self, batch_size: int = 8, workers: Union[int, Literal["auto"]] = "auto") -> None: ...


class Child(Base):
    def __init__(self, root: str, scale: Annotated[float, POSITIVE] = 1.0, **rest) -> None: ...


def test_signature_schema_follows_kwargs_to_the_parent():
    schema = schema_of_callable(Child)
    assert set(schema.fields) == {"root", "scale", "batch_size", "workers"}
    assert not schema.open
    filled = check_mapping("data", {"root": "/x", "batch_size": 4}, schema, "Child")
    assert filled == {"root": "/x", "batch_size": 4, "scale": 1.0, "workers": "auto"}
    with pytest.raises(UserError, match=r"^data.batchsize: unknown key for Child; allowed: batch_size, root, scale, workers$"):
        check_mapping("data", {"root": "/x", "batchsize": 4}, schema, "Child")
    with pytest.raises(UserError, match=r"^data.root: missing \(required by Child\)"):
        check_mapping("data", {}, schema, "Child")
    with pytest.raises(UserError, match=r"^data.workers: 'many' is not an integer or one of 'auto'$"):
        check_mapping("data", {"root": "/x", "workers": "many"}, schema, "Child")
