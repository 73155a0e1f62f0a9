"""The read-only JSON values of claimed outbox messages (``read_only_json``)."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from sdcore.outbox import ReadOnlyDict, ReadOnlyList
from sdcore.outbox._model import read_only_json

NESTED = {"a": {"b": [1, {"c": [2, 3]}]}, "d": "x", "e": None}


def test_every_dict_and_list_inside_becomes_read_only_and_stays_equal() -> None:
    value = read_only_json(json.loads(json.dumps(NESTED)))
    assert value == NESTED
    assert type(value) is ReadOnlyDict
    assert type(value["a"]) is ReadOnlyDict
    assert type(value["a"]["b"]) is ReadOnlyList
    assert type(value["a"]["b"][1]) is ReadOnlyDict
    assert type(value["a"]["b"][1]["c"]) is ReadOnlyList
    assert isinstance(value, dict)
    assert isinstance(value["a"]["b"], list)


@pytest.mark.parametrize("scalar", [None, 0, 1.5, "text", True])
def test_scalars_come_back_as_they_are(scalar: object) -> None:
    assert read_only_json(scalar) is scalar


def _changes(value: Any) -> list[Callable[[], object]]:
    inner = value["a"]["b"]
    return [
        lambda: value.__setitem__("d", 1),
        lambda: value.__delitem__("d"),
        lambda: value.pop("d"),
        lambda: value.popitem(),
        lambda: value.setdefault("z", 1),
        lambda: value.update({"z": 1}),
        lambda: value.clear(),
        lambda: value.__ior__({"z": 1}),
        lambda: inner.append(4),
        lambda: inner.extend([4]),
        lambda: inner.insert(0, 4),
        lambda: inner.pop(),
        lambda: inner.remove(1),
        lambda: inner.reverse(),
        lambda: inner.sort(key=str),
        lambda: inner.clear(),
        lambda: inner.__setitem__(0, 9),
        lambda: inner.__delitem__(0),
        lambda: inner.__iadd__([4]),
        lambda: inner.__imul__(2),
    ]


def test_every_change_is_refused_and_nothing_changes() -> None:
    value = read_only_json(json.loads(json.dumps(NESTED)))
    for change in _changes(value):
        with pytest.raises(TypeError, match=r"read-only .*copy\.deepcopy"):
            change()
    assert value == NESTED


def test_copies_and_pickles_are_plain_and_changeable() -> None:
    value = read_only_json(json.loads(json.dumps(NESTED)))
    deep = copy.deepcopy(value)
    assert deep == NESTED
    assert type(deep) is dict
    assert type(deep["a"]["b"]) is list
    assert type(deep["a"]["b"][1]) is dict
    deep["a"]["b"].append(4)
    assert value["a"]["b"] == [1, {"c": [2, 3]}]
    for shallow in (copy.copy(value), dict(value), value.copy()):
        assert type(shallow) is dict
        assert shallow == NESTED
        shallow["d"] = "y"
    loaded = pickle.loads(pickle.dumps(value))  # noqa: S301 - our own value
    assert loaded == NESTED
    assert type(loaded) is dict
    assert type(loaded["a"]["b"]) is list
    assert value["d"] == "x"


def test_json_and_msgpack_encode_them_like_plain_values() -> None:
    value = read_only_json(json.loads(json.dumps(NESTED)))
    assert json.dumps(value, sort_keys=True) == json.dumps(NESTED, sort_keys=True)
    assert msgpack.unpackb(msgpack.packb(value)) == NESTED
    assert {**value, "jobId": "j"} == {**NESTED, "jobId": "j"}
    assert value | {"z": 1} == {**NESTED, "z": 1}


def test_deep_nesting_needs_no_recursion() -> None:
    depth = 20_000  # far beyond the interpreter's recursion limit
    value: Any = 0
    for _ in range(depth):
        value = {"k": [value]}
    frozen = read_only_json(value)
    node, seen = frozen, 0
    while isinstance(node, dict):
        assert type(node) is ReadOnlyDict
        assert type(node["k"]) is ReadOnlyList
        node, seen = node["k"][0], seen + 1
    assert seen == depth
