"""Shared fixtures: a fresh PostgreSQL database per test, copied from a template of this run.

Two templates are made once per run, on first use: one empty, one holding the whole current
schema (every migration of the lease, outbox and schedules tables, default names). ``pg_dsn``
is a copy of the empty one — what migration tests and "table does not exist" tests need —
unless the test also asks for ``jobs``: then it is the copy with the schema
(``empty_dsn`` is always empty, ``schema_dsn`` always has the schema, ``make_dsn(schema=...)``
makes as many as a test wants).

Names carry this run's id, ``sdcore_test_<UTC yymmddHHMMSS>_<random>_…``, so two runs on one
server (CI jobs, containers whose pytest has the same small pid) never drop or reuse each
other's databases. Each database's comment records the run's host, pid namespace and pid. At
the start of a run, :func:`sweep_stale` drops the databases of other runs only when their run
is certainly over: its pytest process is gone (same host and pid namespace, pid not alive), or
its id is older than :data:`STALE_AFTER`. A live run's databases are never touched.

The server comes from ``SDCORE_TEST_DATABASE_URL`` (or ``DATABASE_URL``; default
``postgresql://postgres@127.0.0.1:5432/postgres``). A missing server is a failure with a hint,
never a silent skip.
"""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import concurrent.futures
import contextlib
import gc
import itertools
import json
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import traceback
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import psycopg
import pytest
import redis.asyncio as aioredis
from psycopg import sql
from psycopg._connection_base import BaseConnection as _BaseConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sdcore.job_scheduler import JobSchedulerService
from sdcore.postgres import Component, migrate

ADMIN_DSN = os.environ.get(
    "SDCORE_TEST_DATABASE_URL",
    os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
)
PREFIX = "sdcore_test_"
STALE_AFTER = timedelta(hours=12)
_STAMP = "%y%m%d%H%M%S"
RUN_STARTED = datetime.now(UTC)
RUN_ID = f"{RUN_STARTED:{_STAMP}}_{secrets.token_hex(3)}"
_NAME = re.compile(rf"{PREFIX}(?P<stamp>[0-9]{{12}})_(?P<rand>[0-9a-f]{{6}})(?:_.*)?")
_LEGACY = re.compile(rf"{PREFIX}[0-9a-f]{{10}}_.*")
_LEGACY_COMMENT = re.compile(r"sdcore test run created ([0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8})")
_counter = itertools.count()
# The components whose tables the schema template holds, under their default names.
SCHEMA_COMPONENTS: tuple[Component, ...] = ("lease", "outbox", "schedules")


UNIT = os.path.join(os.path.dirname(__file__), "unit")
DATABASE_FIXTURES = frozenset({"pg_dsn", "empty_dsn", "schema_dsn", "make_dsn", "jobs"})


ACCEPTANCE = os.path.join(os.path.dirname(__file__), "acceptance")
# pg_advisory_lock key of "the server's room" (any key but the acceptance turn's): every test that
# may use the shared server holds it shared; a test or module marked ``alone`` holds it whole.
ROOM_LOCK_KEY = 0x5DC0_2003_0001
ROOM_LOCK_WAIT = "20min"
# pg_advisory_lock key of the acceptance turn shared by every sdcore test run ("sdcore-accept").
TURN_LOCK_KEY = 0x5DC0_AC_CE_97
TURN_LOCK_WAIT = "20min"


# Where each socket, stream writer and transport of this process was opened (by id, while it
# lives): one left unclosed is found by the collector at some later point, often in another test;
# its ResourceWarning then names the test and the code that opened it, not where the collector ran.
_ORIGINS: dict[int, tuple[str, traceback.StackSummary]] = {}


def _record_origin(obj: object) -> None:
    frames = traceback.StackSummary.extract(
        traceback.walk_stack(sys._getframe(2)), limit=30, lookup_lines=False
    )
    _ORIGINS[id(obj)] = (os.environ.get("PYTEST_CURRENT_TEST", "outside a test"), frames)


def _origin_text(origin: tuple[str, traceback.StackSummary]) -> str:
    test, frames = origin
    return f"opened in {test} at (innermost first)\n{''.join(frames.format())}"


def _trace_socket() -> None:
    """The socket's finalizer is C code that reports its warning itself: say it first here."""
    init = socket.socket.__init__
    finalize: Callable[[socket.socket], None] = getattr(socket.socket, "__del__")  # noqa: B009

    def traced_init(self: socket.socket, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _record_origin(self)

    def traced_del(
        self: socket.socket,
        origins: dict[int, tuple[str, traceback.StackSummary]] = _ORIGINS,
        warn: Callable[..., None] = warnings.warn,
        text: Callable[[tuple[str, traceback.StackSummary]], str] = _origin_text,
    ) -> None:
        # The defaults keep what it needs at interpreter exit, when module globals may be gone.
        origin = origins.pop(id(self), None)
        if origin is not None and self.fileno() != -1:
            message = f"unclosed {self!r}, {text(origin)}"
            self.close()  # the socket's own finalizer then has nothing to say
            warn(message, ResourceWarning, source=self, stacklevel=1)
        finalize(self)

    socket.socket.__init__ = traced_init  # type: ignore[method-assign]
    setattr(socket.socket, "__del__", traced_del)  # noqa: B010 - not in the stubs


def _trace_finalizer(cls: type[Any]) -> None:
    """``cls.__del__`` warns in Python: under ``-W error`` its ResourceWarning is an exception,
    raised again here with the origin."""
    init, finalize = cls.__init__, cls.__del__

    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _record_origin(self)

    def traced_del(
        self: Any,
        origins: dict[int, tuple[str, traceback.StackSummary]] = _ORIGINS,
        text: Callable[[tuple[str, traceback.StackSummary]], str] = _origin_text,
    ) -> None:
        origin = origins.pop(id(self), None)
        try:
            finalize(self)
        except ResourceWarning as exc:
            if origin is None:
                raise
            raise ResourceWarning(f"{exc}: {type(self).__name__} {text(origin)}") from None

    cls.__init__ = traced_init
    cls.__del__ = traced_del


_trace_socket()
_trace_finalizer(asyncio.StreamWriter)
_trace_finalizer(getattr(asyncio.selector_events, "_SelectorTransport"))  # noqa: B009 - private


def pytest_configure(config: pytest.Config) -> None:
    """Run as from a terminal: SIGINT has its default action here and in the programs we start.

    A CI runner (or ``cmd &`` in a shell without job control) hands SIGINT over ignored; an
    ignored signal stays ignored across ``exec``, and Python then installs no
    ``KeyboardInterrupt``: a program the tests stop with "Ctrl-C" would run on. The tests of an
    inherited disposition set theirs in the child (``tests/acceptance/test_demo.py``).
    """
    del config
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def collected_here() -> Iterator[None]:
    """Collect, in the test's teardown (after its event loop closed), what a client left to the
    garbage collector (redis-py's cluster and Sentinel pools drop connections they found dead
    without closing them): the warnings are then this test's, not a later one's on this worker."""
    yield
    gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every unit test ``memory`` (no server), so that ``pytest tests/unit tests/contract
    -k memory`` and ``-m "not postgres"`` select the same socket-free tests; a unit test that
    asks for a database would be marked ``postgres`` instead.

    Then hold every ``memory`` test (and no ``postgres`` one) to it: pytest-socket's
    ``disable_socket`` marker refuses any socket but an ``AF_UNIX`` one (``--allow-unix-socket``
    in ``addopts``: asyncio's self-pipe is one), and :func:`pytest_runtest_setup` refuses libpq's
    connections, which open their sockets in C. The contract tests are marked by
    ``tests/contract/conftest.py`` before this runs (``trylast``).
    """
    del config
    for item in items:
        if str(item.path).startswith(UNIT + os.sep):
            uses_db = DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.postgres if uses_db else pytest.mark.memory)
    for item in items:
        if _socket_free(item):
            item.add_marker(pytest.mark.disable_socket)


def _socket_free(item: pytest.Item) -> bool:
    return item.get_closest_marker("memory") is not None and (
        item.get_closest_marker("postgres") is None
    )


class SocketFreeTestError(RuntimeError):
    """A test of the socket-free tier (marked ``memory``) tried to reach a server."""

    def __init__(self) -> None:
        super().__init__(
            "a socket-free test (marked memory) tried to connect to PostgreSQL: ask for a "
            "database fixture (pg_dsn, schema_dsn, …) so that it is marked postgres, or move it "
            "to tests/integration"
        )


def _refuse_connect(*args: object, **kwargs: object) -> NoReturn:
    raise SocketFreeTestError


# libpq opens its sockets in C, out of pytest-socket's sight: every psycopg connection (sync or
# async, ``psycopg.connect`` included, which is bound at import) is built by this generator.
# Not covered: a subprocess, or libpq driven by hand (``psycopg.pq.PGconn.connect``).
_LIBPQ_CONNECTS = (
    (_BaseConnection, "_connect_gen", _BaseConnection.__dict__["_connect_gen"]),
    (psycopg.Connection, "connect", psycopg.Connection.__dict__["connect"]),
    (psycopg.AsyncConnection, "connect", psycopg.AsyncConnection.__dict__["connect"]),
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a socket-free test's fixtures: refuse psycopg's connections until its teardown."""
    if _socket_free(item):
        for cls, name, _ in _LIBPQ_CONNECTS:
            setattr(cls, name, classmethod(_refuse_connect))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Before the test's fixtures are torn down (the last test's teardown also ends the
    session's fixtures, which drop this run's template databases): psycopg's connections as
    they were; pytest-socket gives the sockets back at this point too."""
    del item
    for cls, name, original in _LIBPQ_CONNECTS:
        setattr(cls, name, original)


class Room:
    """A share of the server's room (see :func:`pytest_runtest_protocol`): shared beside other
    tests, or the whole room for a test or module that must run alone.

    One connection per holder, opened on first use; a server that does not answer is left to
    the test itself to report (:meth:`enter` returns ``False`` and is not tried again).
    """

    def __init__(self, dsn: str = ADMIN_DSN, key: int = ROOM_LOCK_KEY) -> None:
        self._dsn = dsn
        self._key = key
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._broken = False
        self._exclusive = False

    def enter(self, *, exclusive: bool = False) -> bool:
        if self._broken:
            return False
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(
                    self._dsn,
                    autocommit=True,
                    connect_timeout=5,
                    application_name="sdcore-test-room",
                )
                self._conn.execute(f"SET lock_timeout = '{ROOM_LOCK_WAIT}'")
            lock = "pg_advisory_lock" if exclusive else "pg_advisory_lock_shared"
            self._conn.execute(f"SELECT {lock}(%s)", (self._key,))
        except psycopg.errors.LockNotAvailable:
            print(f"the room stayed taken for over {ROOM_LOCK_WAIT}: running anyway")  # noqa: T201
            return False
        except psycopg.Error:
            self._broken = True  # no server: the test's own fixtures say so, with a hint
            self.close()
            return False
        self._exclusive = exclusive
        return True

    def leave(self) -> None:
        if self._conn is None:
            return
        unlock = "pg_advisory_unlock" if self._exclusive else "pg_advisory_unlock_shared"
        try:
            self._conn.execute(f"SELECT {unlock}(%s)", (self._key,))
        except psycopg.Error:
            self.close()  # a closed session holds no lock

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None


_room = Room()


def runs_alone(node: pytest.Item) -> bool:
    """Whether ``node`` (a test, or an acceptance module through its first test) is marked
    ``alone`` and takes the whole room: its fleet fills the server, or its verdict is judged by
    the clock too tightly to share the machine's cores."""
    return node.get_closest_marker("alone") is not None


def _needs_room(item: pytest.Item) -> bool:
    """Whether ``item`` may use the shared server beside others: every test but the socket-free
    ones (``memory`` alone) and the acceptance modules (which hold it module by module)."""
    if str(item.path).startswith(ACCEPTANCE + os.sep):
        return False
    return item.get_closest_marker("postgres") is not None or (
        item.get_closest_marker("memory") is None
    )


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Hold the server's room while ``item`` runs: shared, or whole for a test marked ``alone``.

    Tests of this run's other pytest-xdist workers, and of other runs on the same server, run
    side by side; a test or module marked ``alone`` (the 64-process lease storms, which take most
    of ``max_connections``; the demo's per-second verdict) takes the room exclusively, so
    nothing runs beside it.
    Taken outside pytest-timeout's clock; the wait has its own deadline (then the test runs
    anyway).
    """
    entered = _needs_room(item) and _room.enter(exclusive=runs_alone(item))
    yield
    if entered:
        _room.leave()


class Turn:
    """One test run's turn at the acceptance modules, against other runs on the same server.

    Their process fleets (up to 64 contender processes, three replicas per failover, an embedded
    demo…) each need a large share of the server's ``max_connections`` (100 by default): two
    runs on one server (two CI jobs, two developers) would starve each other. The process that
    hands out the tests (pytest-xdist's controller, or the only process with ``-n 0``) holds a
    server-wide advisory lock from collection to the end of the session when it has acceptance
    tests to run; within the run it is never contended. A run that dies releases it with its
    connection. The wait has its own deadline; past it the run goes on without the lock (and may
    then fail for want of connections, which says why).
    """

    def __init__(self, dsn: str = ADMIN_DSN, key: int = TURN_LOCK_KEY) -> None:
        self._dsn = dsn
        self._key = key
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    @property
    def held(self) -> bool:
        return self._conn is not None

    def take(self) -> None:
        if self._conn is not None:
            return
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, application_name="sdcore-test-turn")
        except psycopg.Error:
            return  # no server: the tests' own fixtures say so, with a hint
        conn.execute(f"SET lock_timeout = '{TURN_LOCK_WAIT}'")
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (self._key,))
        except psycopg.errors.LockNotAvailable:
            conn.close()
            print(  # noqa: T201 - shown with the run's output
                f"another test run held the acceptance turn for over {TURN_LOCK_WAIT}: "
                "running without it"
            )
            return
        self._conn = conn

    def give(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()


_turn = Turn()


def _has_acceptance(nodeids: Iterable[str]) -> bool:
    return any(nodeid.startswith("tests/acceptance/") for nodeid in nodeids)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without pytest-xdist (``-n 0``): take the run's turn if it has acceptance tests."""
    if not hasattr(session.config, "workerinput") and _has_acceptance(
        item.nodeid for item in session.items
    ):
        _turn.take()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the suite's lanes (``tests/_lanes.py``)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests._lanes import LaneScheduling

    return LaneScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: Sequence[str]) -> None:
    """pytest-xdist's controller, before it hands out any test: the run's turn (see
    :class:`Turn`), once."""
    del node
    if _has_acceptance(ids):
        _turn.take()


def pytest_sessionfinish() -> None:
    _room.close()
    _turn.give()


def dsn_for(dbname: str) -> str:
    """Return the admin DSN pointed at another database."""
    params = conninfo_to_dict(ADMIN_DSN)
    params["dbname"] = dbname
    return make_conninfo(**{k: str(v) for k, v in params.items()})


def unique_name(tag: str = "") -> str:
    """A database name (or any server-wide name) unique to this run and call."""
    return f"{PREFIX}{RUN_ID}_{tag}{next(_counter)}"


TOO_MANY_CONNECTIONS = "53300"


def admin_connect(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit connection to ``dsn``, or a test failure that says what is wrong.

    A server that is up but out of connection slots (SQLSTATE 53300: other workloads hold its
    ``max_connections``) is not an unreachable one: the advice differs.
    """
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        if exc.sqlstate == TOO_MANY_CONNECTIONS or "too many clients" in str(exc):
            pytest.fail(
                "PostgreSQL is up but out of connection slots (SQLSTATE 53300, "
                f"{_slots(dsn)}): other clients hold them. The suite needs about 70 "
                "connections at its peak; run it against a dedicated server (see .ci/run) or "
                "point SDCORE_TEST_DATABASE_URL at one.",
                pytrace=False,
            )
        pytest.fail(
            f"PostgreSQL is not reachable ({exc}). Start it (see .ci/run) or set "
            "SDCORE_TEST_DATABASE_URL.",
            pytrace=False,
        )


def _slots(dsn: str) -> str:
    """``max_connections=N, M in use``, read over a superuser's reserved slot when one is free."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT current_setting('max_connections'), count(*) FROM pg_stat_activity"
                " WHERE backend_type = 'client backend'"
            ).fetchone()
    except psycopg.Error:
        return "every slot taken"
    return "every slot taken" if row is None else f"max_connections={row[0]}, {row[1]} in use"


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return admin_connect(ADMIN_DSN)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]": one per container
    except OSError:
        return ""


OWNER = {"host": socket.gethostname(), "pidns": _pid_namespace(), "pid": os.getpid()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def is_stale(name: str, comment: str | None, now: datetime) -> bool:
    """Whether ``name`` belongs to another run that is certainly over.

    Over means: its id (the UTC start in the name) is older than :data:`STALE_AFTER`, or it was
    made on this host, in this pid namespace, by a pid that is no longer alive. A name of this
    run, or one that does not follow the scheme, is never stale — except a name of the scheme
    before (``sdcore_test_<10 hex>_…``, "created <UTC time>" in its comment) once that is older
    than :data:`STALE_AFTER`.
    """
    if name.startswith(f"{PREFIX}{RUN_ID}"):
        return False
    match = _NAME.fullmatch(name)
    if match is None:
        # The scheme before run ids had a timestamp: a creation stamp in the comment.
        legacy = _LEGACY.fullmatch(name) and _LEGACY_COMMENT.fullmatch(comment or "")
        if not legacy:
            return False
        created = datetime.strptime(legacy[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        return now - created > STALE_AFTER
    started = datetime.strptime(match["stamp"], _STAMP).replace(tzinfo=UTC)
    if now - started > STALE_AFTER:
        return True
    try:
        owner = json.loads(comment or "")
    except ValueError:
        return False
    if not isinstance(owner, dict):
        return False
    same_host = owner.get("host") == OWNER["host"] and owner.get("pidns") == OWNER["pidns"]
    pid = owner.get("pid")
    return bool(same_host and OWNER["pidns"] and isinstance(pid, int) and not _alive(pid))


def sweep_stale(conn: psycopg.Connection[tuple[object, ...]]) -> list[str]:
    """Drop the test databases of runs that are over (see :func:`is_stale`); return their names."""
    rows = conn.execute(
        "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database"
        " WHERE datname LIKE %s AND NOT datistemplate",
        (PREFIX.replace("_", r"\_") + "%",),
    ).fetchall()
    now = datetime.now(UTC)
    dropped = []
    for name, comment in rows:
        if is_stale(str(name), None if comment is None else str(comment), now):
            try:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(str(name))
                    )
                )
            except psycopg.Error:
                continue  # another run's sweep dropped it first
            dropped.append(str(name))
    return dropped


def _create(conn: psycopg.Connection[tuple[object, ...]], name: str, template: str) -> None:
    conn.execute(
        sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    )
    comment = json.dumps({**OWNER, "run": RUN_ID})
    conn.execute(
        sql.SQL("COMMENT ON DATABASE {} IS {}").format(sql.Identifier(name), sql.Literal(comment))
    )


def _drop(conn: psycopg.Connection[tuple[object, ...]], name: str) -> None:
    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class _Dropper:
    """Drops the databases of finished tests on a thread of its own.

    ``DROP DATABASE`` waits for a checkpoint, seconds on a busy shared server; the next test need
    not wait for it. :meth:`close` (at the end of the run) waits for every drop.
    """

    DRAIN_TIMEOUT_S = 300

    def __init__(self) -> None:
        self._names: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def drop(self, name: str) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drop-test-dbs", daemon=True)
                self._thread.start()
        self._names.put(name)

    def _run(self) -> None:
        with _admin() as conn:
            while (name := self._names.get()) is not None:
                # On failure the name is left for the next run's sweep (this run is over by then).
                with contextlib.suppress(psycopg.Error):
                    _drop(conn, name)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._names.put(None)
            thread.join(self.DRAIN_TIMEOUT_S)


_dropper = _Dropper()


async def _apply_schema(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for component in SCHEMA_COMPONENTS:
            await migrate(conn, component)


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """An empty template database for this run (also sweeps the databases of finished runs)."""
    name = f"{PREFIX}{RUN_ID}_tmpl"
    with _admin() as conn:
        sweep_stale(conn)
        _create(conn, name, "template0")
    yield name
    _dropper.close()  # every test database made from it is gone first
    with _admin() as conn:
        _drop(conn, name)


@pytest.fixture(scope="session")
def schema_template_db(template_db: str) -> Iterator[str]:
    """A template holding the current schema: every migration applied once per run."""
    name = f"{PREFIX}{RUN_ID}_tmpl_schema"
    with _admin() as conn:
        _create(conn, name, template_db)
    # On a thread of its own: this fixture may be requested from inside a running event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _apply_schema(dsn_for(name))).result()
    yield name
    with _admin() as conn:
        _drop(conn, name)


@pytest.fixture
def make_dsn(request: pytest.FixtureRequest, template_db: str) -> Iterator[Callable[..., str]]:
    """A factory of fresh databases, empty or (``schema=True``) with the schema; all dropped
    after the test."""
    made: list[str] = []

    def make(*, schema: bool = False) -> str:
        template = request.getfixturevalue("schema_template_db") if schema else template_db
        name = unique_name()
        with _admin() as conn:
            _create(conn, name, template)
        made.append(name)
        return dsn_for(name)

    yield make
    for name in made:
        _dropper.drop(name)


@pytest.fixture
def empty_dsn(make_dsn: Callable[..., str]) -> str:
    """DSN of a fresh, empty database (dropped after the test)."""
    return make_dsn()


@pytest.fixture
def pg_dsn(request: pytest.FixtureRequest, make_dsn: Callable[..., str]) -> str:
    """DSN of a fresh database (dropped after the test): empty, or copied with the schema when
    the test also uses ``jobs`` (then it is the service's database)."""
    return make_dsn(schema="jobs" in request.fixturenames)


@pytest.fixture
def schema_dsn(make_dsn: Callable[..., str]) -> str:
    """DSN of a fresh database copied with the current schema (dropped after the test)."""
    return make_dsn(schema=True)


@pytest.fixture
async def jobs(pg_dsn: str) -> AsyncIterator[JobSchedulerService]:
    """A connected service on a database copied with the schema (``ensure_schema`` is a no-op
    there, and checks it)."""
    async with JobSchedulerService.connect(pg_dsn) as service:
        await service.ensure_schema()
        yield service


REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")


async def delete_prefix(client: aioredis.Redis, prefix: str) -> None:
    """Delete every key under the BullMQ ``prefix`` (in chunks: a prefix may hold many)."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
    for start in range(0, len(keys), 500):
        await client.delete(*keys[start : start + 500])


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    """A client of the shared Redis (``decode_responses=True``)."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.fail(
            f"Redis is not reachable at {REDIS_URL} ({exc}). Start it (see .ci/run) or set "
            "SDCORE_TEST_REDIS_URL.",
            pytrace=False,
        )
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis: aioredis.Redis) -> AsyncIterator[str]:
    """A key prefix of this test on the shared Redis; its keys are deleted afterwards."""
    name = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    yield name
    await delete_prefix(redis, name)
