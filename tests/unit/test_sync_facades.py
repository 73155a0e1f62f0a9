"""The blocking facades mirror their async objects: the same methods, parameters and defaults."""

from __future__ import annotations

import inspect

import pytest

import sdcore.outbox
import sdcore.scheduling
import sdcore.sync


def _public_methods(cls: type) -> set[str]:
    return {
        name
        for name, member in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(member)
    }


def _parameters(function: object) -> list[tuple[str, object, object]]:
    signature = inspect.signature(function)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


@pytest.mark.parametrize(
    ("blocking", "async_twin"),
    [
        (sdcore.sync.ScheduleAdmin, sdcore.scheduling.ScheduleAdmin),
        (sdcore.sync.OutboxAdmin, sdcore.outbox.OutboxAdmin),
    ],
    ids=["ScheduleAdmin", "OutboxAdmin"],
)
def test_every_async_method_has_a_blocking_twin(blocking: type, async_twin: type) -> None:
    missing = _public_methods(async_twin) - _public_methods(blocking)
    assert missing == set()
    for name in _public_methods(async_twin):
        async_method = getattr(async_twin, name)
        assert inspect.iscoroutinefunction(async_method)
        assert not inspect.iscoroutinefunction(getattr(blocking, name))
        assert _parameters(getattr(blocking, name)) == _parameters(async_method), name
        returns = inspect.signature(async_method).return_annotation
        assert inspect.signature(getattr(blocking, name)).return_annotation == returns, name


def test_the_outbox_takes_the_async_outboxs_keywords_and_defaults() -> None:
    assert _parameters(sdcore.sync.Outbox) == _parameters(sdcore.outbox.Outbox)
    for name in ("enqueue_once", "complete_and_enqueue", "job_id", "schema_sql"):
        assert _parameters(getattr(sdcore.sync.Outbox, name)) == _parameters(
            getattr(sdcore.outbox.Outbox, name)
        ), name
