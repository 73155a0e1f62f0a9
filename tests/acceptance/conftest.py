"""Acceptance modules: each holds the server's room while it runs, two side by side at most.

Every test here is marked ``acceptance`` (:func:`pytest_collection_modifyitems`). They start real
processes and judge them by the clock, so the README's test command runs them this way:

- ``pytest -m "acceptance and alone" -n 0``: the modules marked ``alone``, one at a time — the
  64-process lease storms (they take most of ``max_connections``) and the verdicts judged too
  tightly by the clock to share the machine's cores (the demo's per-second ticks, the
  dashboard's browser tests);
- ``pytest -m "not (acceptance and alone)" -n 4 --dist loadgroup``: everything else. The other
  acceptance modules go in two **lanes** (``tests/_lanes.py``), each one module after the other
  on a worker of its own, so two of them run side by side at most; the rest of the suite runs
  on the other two workers beside them (and on a lane's worker once its lane is done).
  Acceptance modules mostly wait on their processes (two side by side used 60 % of one core),
  and so does most of the rest: together they fill the two cores that each left half idle.

Each module holds the server's room (``tests/conftest.py``) from its first test's setup to its
last test's teardown — shared, or whole for an ``alone`` module — so a run that selects both
kinds at once still runs an ``alone`` module with nothing beside it, and another run's tests
never open connections under a storm. Across runs the acceptance modules take turns (``Turn``
in ``tests/conftest.py``). The room is taken in an outermost ``pytest_runtest_protocol``
wrapper, before pytest-timeout starts a test's clock: waiting for it is not the test's time.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from tests.conftest import Room, runs_alone

# The room of the module this process runs, and that module's node id (None: none held).
_room = Room()
_module: str | None = None


def _take_room(item: pytest.Item) -> None:
    """Hold the room for ``item``'s module (whole for an ``alone`` module)."""
    global _module
    _room.enter(exclusive=runs_alone(item))
    _module = _module_of(item)


def _give_room() -> None:
    global _module
    if _module is not None:
        _room.leave()
        _module = None


HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``acceptance`` (pytest calls this hook with the whole
    session's items: the others are left alone)."""
    del config
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.acceptance)


def _module_of(item: pytest.Item | None) -> str | None:
    return None if item is None else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    if not str(item.path).startswith(HERE + os.sep):
        # pytest (and pytest-xdist) call this hook through ``config.hook``, for every item of the
        # session, not only for this folder's: the rest of the suite holds the room per test.
        yield
        return
    module = _module_of(item)
    if module != _module:
        _give_room()  # a module that ended without reaching its last item
        _take_room(item)
    yield
    if _module_of(nextitem) != module:
        _give_room()  # after the module's teardown: another module's turn


def pytest_sessionfinish() -> None:
    _give_room()
    _room.close()
