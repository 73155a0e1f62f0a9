"""Every public error is an SdcoreError and still the builtin that fits it."""

from __future__ import annotations

import importlib

import pytest

from sdcore import SdcoreError

PACKAGES = [
    "sdcore.job_scheduler",
    "sdcore.scheduling",
    "sdcore.events",
    "sdcore.outbox",
    "sdcore.queues",
    "sdcore.postgres",
    "sdcore.runtime",
    "sdcore.sqlalchemy",
    "sdcore.demo",
    "sdcore.alerting",
]


# Not ours: BullMQ's own class, re-exported so that processors can raise it.
FOREIGN = {"sdcore.queues.UnrecoverableError"}


def _public_errors() -> list[tuple[str, type[BaseException]]]:
    found = []
    for name in PACKAGES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            value = getattr(module, attr)
            full = f"{name}.{attr}"
            if isinstance(value, type) and issubclass(value, BaseException) and full not in FOREIGN:
                found.append((full, value))
    return found


ERRORS = _public_errors()


@pytest.mark.parametrize(("name", "cls"), ERRORS, ids=[name for name, _ in ERRORS])
def test_every_public_error_is_an_sdcore_error(name: str, cls: type[BaseException]) -> None:
    assert issubclass(cls, SdcoreError), name
    # ... and something more specific than Exception, except for the feature roots.
    builtins = [b for b in cls.__mro__ if b.__module__ == "builtins" and b is not object]
    assert builtins[0] is not BaseException


def test_the_tree_is_drawn_for_every_public_error() -> None:
    import sdcore.exceptions

    doc = sdcore.exceptions.__doc__ or ""
    missing = [name for name, cls in ERRORS if cls.__name__ not in doc]
    assert missing == []
