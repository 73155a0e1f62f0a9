"""How pytest-xdist spreads this repository's suite over its workers.

Here and not in ``tests/conftest.py``: the controller process collects nothing, so it loads only
the conftest files of its command-line arguments' folders — with no arguments (``.venv/bin/pytest``,
the README's command) that is this folder's.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``pytest -n N`` (the project's default, ``--dist load``): every acceptance test in one
    work unit, the other tests one by one.

    The acceptance modules take turns anyway (``tests/acceptance/conftest.py``), so spread over
    workers they would only make each other wait; as one unit they run on one worker, in file
    order, first (the largest unit goes out first), while the other workers share the rest.
    pytest-xdist's own ``--dist loadgroup`` would do this with a marker, but it cannot rename
    items under pytest 9.2 (the group is silently ignored).
    """
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist: pytest-xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class AcceptanceTogether(LoadScopeScheduling):  # type: ignore[misc]  # untyped package
        def _split_scope(self, nodeid: str) -> str:
            return "tests/acceptance" if nodeid.startswith("tests/acceptance/") else nodeid

    return AcceptanceTogether(config, log)
