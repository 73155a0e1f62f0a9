"""The doubles' names of earlier releases still work for one release, each with a warning."""

from __future__ import annotations

import importlib

import pytest

import sdcore.testing
from sdcore.job_scheduler._memory import MemoryJobScheduler
from sdcore.scheduling._memory_store import MemoryScheduleStore


@pytest.mark.parametrize(
    ("module", "old", "new", "double"),
    [
        ("sdcore.testing", "InMemoryJobScheduler", "MemoryJobScheduler", MemoryJobScheduler),
        ("sdcore.testing", "InMemoryScheduleStore", "MemoryScheduleStore", MemoryScheduleStore),
        ("sdcore.scheduling", "InMemoryScheduleStore", "MemoryScheduleStore", MemoryScheduleStore),
    ],
    ids=["testing-jobs", "testing-schedules", "scheduling-schedules"],
)
def test_an_old_name_warns_and_returns_the_renamed_double(
    module: str, old: str, new: str, double: type
) -> None:
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is deprecated; use .*{new}"):
        found = getattr(importlib.import_module(module), old)
    assert found is double
    assert old not in importlib.import_module(module).__all__


def test_the_doubles_sit_next_to_their_postgresql_twins() -> None:
    assert sdcore.testing.MemoryJobScheduler.__module__ == "sdcore.job_scheduler._memory"
    assert sdcore.testing.MemoryOutboxStore.__module__ == "sdcore.outbox._memory_store"
    assert sdcore.testing.MemoryScheduleStore.__module__ == "sdcore.scheduling._memory_store"


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchDouble"):
        sdcore.testing.NoSuchDouble  # noqa: B018
