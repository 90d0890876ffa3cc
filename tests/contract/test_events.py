"""The engine -> UI contract: every event is frozen and slotted, holds only plain types,
and survives JSON (the trace format `generate --json` writes and `--replay` reads)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from enum import Enum
from typing import Any

import pytest

from specchat.engine import events

EVENTS = typing.get_args(events.Event)
NESTED = (events.ModelInfo, events.TurnStats)  # records carried inside events
RECORDS = (*EVENTS, *NESTED)
PLAIN = (str, int, float, bool, type(None))


def plain_type(tp: Any) -> bool:
    """str, int, float, bool, None, an enum, a tuple of those, or a record of the contract."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return all(plain_type(a) for a in typing.get_args(tp))
    if origin is tuple:
        return all(plain_type(a) for a in typing.get_args(tp) if a is not Ellipsis)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return True
    return tp in PLAIN or tp in RECORDS


def example(tp: Any, n: int) -> Any:
    """A value of type tp, not the field's default (n varies it between fields)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return example(args[0], n)
    if origin is tuple:
        inner = typing.get_args(tp)[0]
        return (example(inner, n), example(inner, n + 1))
    if isinstance(tp, type) and issubclass(tp, Enum):
        members = list(tp)
        return members[n % len(members)]
    if tp in RECORDS:
        return build(tp, n)
    return {str: f"text {n} é🙂", int: 7 + n, float: 0.25 + n, bool: n % 2 == 0}[tp]


def build(cls: type, n: int = 0) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: example(hints[f.name], n + i) for i, f in enumerate(dataclasses.fields(cls))})


def test_the_union_names_every_event() -> None:
    defined = {
        obj
        for obj in vars(events).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == events.__name__
    }
    assert defined == set(RECORDS)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_each_record_is_frozen_slotted_and_plain(cls: type) -> None:
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen, f"{cls.__name__} is not frozen"
    assert "__slots__" in cls.__dict__, f"{cls.__name__} is not slotted"
    hints = typing.get_type_hints(cls)
    wrong = {f.name: hints[f.name] for f in dataclasses.fields(cls) if not plain_type(hints[f.name])}
    assert wrong == {}
    value = build(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, dataclasses.fields(cls)[0].name, None)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_each_record_round_trips_through_json(cls: type) -> None:
    for n in (0, 1):
        value = build(cls, n)
        text = json.dumps(events.to_dict(value))
        again = events.from_dict(json.loads(text))
        assert again == value and type(again) is cls
    assert build(cls, 0) != build(cls, 1)  # the examples differ, so == was tested


def test_plain_type_refuses_what_the_contract_forbids() -> None:
    assert not plain_type(list[int]) and not plain_type(dict[str, int]) and not plain_type(object)
    assert plain_type(tuple[str, ...]) and plain_type(events.Provenance | None)
