"""The suite's lanes (``tests/_lanes.py``): how ``--dist loadgroup`` groups acceptance modules."""

from __future__ import annotations

from tests._lanes import DEFAULT_S, EXPECTED_S, LANES, LaneScheduling, lanes


def _total(assigned: dict[str, int], lane: int) -> int:
    return sum(
        EXPECTED_S.get(m.rsplit("/", 1)[-1], DEFAULT_S) for m, i in assigned.items() if i == lane
    )


def test_every_module_gets_a_lane_and_the_lanes_end_within_one_module_of_each_other() -> None:
    modules = [f"tests/acceptance/{name}" for name in EXPECTED_S] + ["tests/acceptance/test_new.py"]
    assigned = lanes(modules)
    assert set(assigned) == set(modules)
    assert set(assigned.values()) == set(range(LANES))
    totals = [_total(assigned, lane) for lane in range(LANES)]
    assert max(totals) - min(totals) <= max(EXPECTED_S.values())


def test_the_lanes_depend_on_the_set_of_modules_only() -> None:
    modules = [f"tests/acceptance/{name}" for name in EXPECTED_S]
    assert lanes(modules) == lanes(reversed(modules)) == lanes(modules + modules[:3])


def test_acceptance_modules_share_their_lane_unit_and_other_tests_are_units_of_their_own() -> None:
    scheduler = LaneScheduling.__new__(LaneScheduling)
    scheduler._lanes = lanes(["tests/acceptance/test_a.py", "tests/acceptance/test_b.py"])
    lane_a = scheduler._split_scope("tests/acceptance/test_a.py::test_one")
    assert lane_a == scheduler._split_scope("tests/acceptance/test_a.py::test_two")
    assert lane_a.startswith("acceptance-lane-")
    assert lane_a != scheduler._split_scope("tests/acceptance/test_b.py::test_one")
    unit = "tests/unit/test_x.py::test_y[1]"
    assert scheduler._split_scope(unit) == unit
