"""How pytest-xdist spreads this repository's suite over its workers.

Here and not in ``tests/conftest.py``: the controller process collects nothing, so it loads only
the conftest files of its command-line arguments' folders — with no arguments (``.venv/bin/pytest``,
``-n 2`` from ``addopts``) that is this folder's.
"""

from __future__ import annotations

from typing import Any

import pytest

ACCEPTANCE = "tests/acceptance"
# Tests that run in the acceptance tests' work unit under pytest-xdist (alone on the machine):
# the acceptance modules, and the other tests that judge a schedule by the wall clock.
ALONE = (
    ACCEPTANCE + "/",
    # A per-second schedule must show no missed tick (one was missed beside another worker).
    "tests/integration/test_dashboard_browser.py::",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n N`` (``--dist load``; ``-n 2`` is the default): the acceptance tests
    (and the other tests in :data:`ALONE`) first, as one work unit on one worker, alone on the
    machine; then every other test, spread over all workers one by one.

    The acceptance modules start real processes and judge them by the clock — a replica killed
    mid-run, a lease expiring, an overlap that must (or must not) happen within seconds — so
    they run as they would in one process: nothing else of the run beside them (runs with
    other tests beside them failed, 2026-12-03: a demo tick missed, SC-11's control saw no
    overlap). They also take turns with other runs' acceptance modules
    (``tests/acceptance/conftest.py``), which as one unit on one worker never wait for each
    other. pytest-xdist's own ``--dist loadgroup`` cannot group them under pytest 9.2 (it
    renames items through ``_nodeid``, which ``Node.nodeid`` no longer reads).
    """
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist: pytest-xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class AcceptanceFirst(LoadScopeScheduling):  # type: ignore[misc]  # untyped package
        def _split_scope(self, nodeid: str) -> str:
            return ACCEPTANCE if nodeid.startswith(ALONE) else nodeid

        def _acceptance_running(self) -> bool:
            return any(
                not all(work[ACCEPTANCE].values())
                for work in self.assigned_work.values()
                if ACCEPTANCE in work
            )

        def _reschedule(self, node: Any) -> None:
            if self._acceptance_running() and ACCEPTANCE not in self.assigned_work.get(node, {}):
                return  # this worker waits until the acceptance tests are over
            super()._reschedule(node)

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            running = self._acceptance_running()
            super().mark_test_complete(node, item_index, duration)
            if running and not self._acceptance_running():
                for other in self.nodes:  # the waiting workers start on the rest
                    if other is not node:
                        self._reschedule(other)

    return AcceptanceFirst(config, log)
