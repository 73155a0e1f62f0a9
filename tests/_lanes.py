"""The suite's pytest-xdist scheduler for ``--dist loadgroup``: acceptance modules in lanes.

The README's second pytest step runs the acceptance modules not marked ``alone`` together with
the rest of the suite (``pytest -m "not (acceptance and alone)" -n 4 --dist loadgroup``). The
acceptance modules go in :data:`LANES` lanes: each lane is one work unit, its modules one after
the other on one worker, so no more than two fleets run side by side (they are judged by the
clock); every other test is a unit of its own, handed to whichever worker is free. The lanes are
the largest units, and pytest-xdist hands the largest out first: they start at once, and the
rest of the suite fills the other workers beside them.

pytest-xdist's own ``loadgroup`` (tests marked ``xdist_group``) renames each grouped test's node
id, which pytest 9.2 no longer lets a plugin do; this scheduler replaces it for this suite (no
test here is marked ``xdist_group``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

__all__ = ["DEFAULT_S", "EXPECTED_S", "LANES", "LaneScheduling", "lanes"]

ACCEPTANCE = "tests/acceptance/"
LANES = 2
# Each module's wall time in seconds, two side by side (``pytest -m "acceptance and not alone"
# --dist loadfile --durations=0``, 2026-12-06): the lanes are balanced on it. A module not
# listed counts as DEFAULT_S; a wrong figure only makes one lane end later than the other.
EXPECTED_S = {
    "test_cluster_walk.py": 46,
    "test_control_processes.py": 56,
    "test_control_sigstop.py": 11,
    "test_django_admin_browser.py": 20,
    "test_django_workers.py": 11,
    "test_failover.py": 43,
    "test_gunicorn_workers.py": 18,
    "test_lease_many_processes.py": 6,
    "test_outbox_celery.py": 43,
    "test_outbox_celery_redis.py": 16,
    "test_outbox_faults.py": 17,
    "test_outbox_poison_campaign.py": 26,
    "test_owners_processes.py": 11,
    "test_scheduling_processes.py": 62,
    "test_scheduling_retries.py": 60,
}
DEFAULT_S = 20


def lanes(modules: Iterable[str]) -> dict[str, int]:
    """Module path -> lane: longest first, each to the lane that ends first so far (ties: the
    lower lane); a function of the set of modules only."""
    ends = [0] * LANES

    def expected(module: str) -> int:
        return EXPECTED_S.get(module.rsplit("/", 1)[-1], DEFAULT_S)

    out: dict[str, int] = {}
    for module in sorted(set(modules), key=lambda m: (-expected(m), m)):
        lane = min(range(LANES), key=lambda i: (ends[i], i))
        ends[lane] += expected(module)
        out[module] = lane
    return out


class LaneScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """Acceptance modules in lanes, every other test a unit of its own (see the module)."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._lanes: dict[str, int] | None = None

    def schedule(self) -> None:
        if self._lanes is None and self.registered_collections:
            collection = next(iter(self.registered_collections.values()))
            self._lanes = lanes(
                nodeid.split("::", 1)[0] for nodeid in collection if nodeid.startswith(ACCEPTANCE)
            )
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if self._lanes is not None and module in self._lanes:
            return f"acceptance-lane-{self._lanes[module]}"
        return nodeid
