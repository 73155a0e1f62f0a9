"""The components that start and stop share ``AsyncStartStop``: ``async with`` starts, and
leaving the block stops (``close`` for the queues' classes), whatever ends the block."""

from __future__ import annotations

from typing import Any

import pytest

from sdcore._internal.lifecycle import AsyncStartStop
from sdcore.outbox import OutboxRelay
from sdcore.queues import BullMQPublisher, Workers


@pytest.mark.parametrize(
    ("cls", "closer"), [(OutboxRelay, "stop"), (BullMQPublisher, "close"), (Workers, "close")]
)
async def test_async_with_starts_and_always_stops(cls: type[Any], closer: str) -> None:
    assert issubclass(cls, AsyncStartStop)
    calls: list[str] = []
    component = cls.__new__(cls)

    async def start() -> None:
        calls.append("start")

    async def stop() -> None:
        calls.append(closer)

    component.start = start  # type: ignore[method-assign]
    setattr(component, closer, stop)
    async with component as entered:
        assert entered is component
    with pytest.raises(ValueError, match="boom"):
        async with component:
            raise ValueError("boom")
    assert calls == ["start", closer, "start", closer]
