"""The server's room (``tests/conftest.py``): tests share it, a module that runs alone has it
whole; the acceptance turn keeps two runs apart; and the acceptance modules' room
(``tests/acceptance/conftest.py``) is taken for their items only.

Each test here uses a key of its own, never the suite's ``ROOM_LOCK_KEY``: this test itself
holds the real room shared while it runs.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest

from tests._servers import free_port
from tests.acceptance import conftest as acceptance_conftest
from tests.conftest import ADMIN_DSN, Room, Turn


def _key() -> int:
    return secrets.randbits(62)


def _try_exclusive(key: int) -> bool:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        assert row is not None
        return bool(row[0])  # the session ends with the block: a lock it got is released


def test_a_test_waits_while_a_module_has_the_room_alone() -> None:
    key = _key()
    room = Room(key=key)
    entered = threading.Event()
    with psycopg.connect(ADMIN_DSN, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))

        def enter() -> None:
            if room.enter():
                entered.set()

        thread = threading.Thread(target=enter, daemon=True)
        thread.start()
        assert not entered.wait(0.5), "entered a room held exclusively"
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
        assert entered.wait(10), "still waiting after the room was given up"
    thread.join(10)
    room.leave()
    room.close()


def test_tests_share_the_room_and_keep_a_module_out_until_they_leave() -> None:
    key = _key()
    first, second = Room(key=key), Room(key=key)
    try:
        assert first.enter()
        assert second.enter()  # shared: neither waits for the other
        assert not _try_exclusive(key)
        first.leave()
        assert not _try_exclusive(key)
        second.leave()
        deadline = time.monotonic() + 5
        while not _try_exclusive(key):
            assert time.monotonic() < deadline, "the room stayed taken after both left"
            time.sleep(0.05)
        assert first.enter()  # the same connection, again
        first.leave()
    finally:
        first.close()
        second.close()


def test_a_server_that_does_not_answer_is_left_to_the_test() -> None:
    room = Room(dsn=f"host=127.0.0.1 port={free_port()} dbname=postgres user=postgres")
    started = time.monotonic()
    assert room.enter() is False
    assert room.enter() is False  # not tried again
    room.leave()
    room.close()
    assert time.monotonic() - started < 10


def test_a_module_alone_keeps_the_room_from_shared_holders_and_waits_for_them() -> None:
    key = _key()
    shared, alone = Room(key=key), Room(key=key)
    entered = threading.Event()
    try:
        assert shared.enter()

        def enter_alone() -> None:
            if alone.enter(exclusive=True):
                entered.set()

        thread = threading.Thread(target=enter_alone, daemon=True)
        thread.start()
        assert not entered.wait(0.5), "took the whole room while a test shared it"
        shared.leave()
        assert entered.wait(10), "still waiting after the shared holder left"
        thread.join(10)
        assert not _try_shared(key), "a test entered beside a module that runs alone"
        alone.leave()
        assert _try_shared(key)
    finally:
        shared.close()
        alone.close()


def _try_shared(key: int) -> bool:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock_shared(%s)", (key,)).fetchone()
        assert row is not None
        return bool(row[0])


def test_a_second_run_waits_for_the_first_run_s_turn() -> None:
    key = _key()
    first, second = Turn(key=key), Turn(key=key)
    taken = threading.Event()
    try:
        first.take()
        assert first.held

        def take() -> None:
            second.take()
            taken.set()

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        assert not taken.wait(0.5), "two runs had the acceptance turn at once"
        first.give()
        assert taken.wait(10), "the second run still waits after the first gave its turn"
        thread.join(10)
        assert second.held
    finally:
        first.give()
        second.give()


def test_only_the_acceptance_modules_hold_the_room_module_by_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pytest calls pytest_runtest_protocol through config.hook, so a conftest's wrapper sees
    # every item of the session: the acceptance modules' room must ignore the other folders'.
    def refuse(item: object) -> None:
        raise AssertionError(f"a module room taken for a test outside tests/acceptance ({item})")

    monkeypatch.setattr(acceptance_conftest, "_take_room", refuse)
    here = SimpleNamespace(
        path=Path(__file__),
        nodeid="tests/integration/test_test_room.py::t",
        get_closest_marker=lambda name: None,
    )
    wrapper = acceptance_conftest.pytest_runtest_protocol(here, None)  # type: ignore[arg-type]
    next(wrapper)
    with pytest.raises(StopIteration):
        next(wrapper)
    assert acceptance_conftest._module is None
