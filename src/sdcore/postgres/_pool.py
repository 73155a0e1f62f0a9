"""The connection pool sdcore opens for itself: reconnect timing, open timeout, pooler mode.

``psycopg_pool`` replaces a broken connection with a backoff of 1, 2, 4 … seconds; after a failover
that step, not the database, decides when the service works again: the longer the HA tool takes
to promote a standby, the further the doubling has run. Here the backoff doubles from a small
first delay and is capped, so a promoted standby is used within about a second of accepting
connections (``docs/benchmarks.md#failover``).

Opening waits for the first connection up to a deadline, but a server that *refuses* (unknown
database or role, failed authentication) fails at once, with the server's own words instead of
"pool initialization incomplete after 30 sec".
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff, BasePool

from sdcore._internal.validation import boolean, int_between, shown, text
from sdcore.exceptions import SdcoreError
from sdcore.postgres._dsn import redact_dsn, redact_text

# Refusals no retry can cure (libpq reports no SQLSTATE for them, only the server's text).
_PERMANENT = re.compile(
    r'database "[^"]*" does not exist|role "[^"]*" does not exist|password authentication failed'
    r"|no pg_hba\.conf entry|authentication failed|password is required|invalid connection option"
    r"|unsupported startup parameter",
    re.IGNORECASE,
)
DEFAULT_CONNECT_TIMEOUT_S = 10


class DatabaseConnectError(SdcoreError, ConnectionError):
    """No connection to the database could be opened.

    Attributes:
        dsn: The connection string, password masked.
        reason: The driver's (and server's) explanation, password masked.
        permanent: The server refused in a way retrying cannot fix (unknown database, bad auth).
    """

    def __init__(self, *, dsn: str, reason: str, permanent: bool) -> None:
        self.dsn = dsn
        self.reason = reason
        self.permanent = permanent
        super().__init__(f"cannot connect to {dsn}: {reason}")


_INT_MAX = 2**31 - 1  # the largest millisecond value PostgreSQL and asyncio both take


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSettings:
    """How sdcore opens, sizes and re-opens the connections of a pool it creates.

    ``Runtime(pool=…)`` and ``JobSchedulerService.connect(pool=…)`` take one; the defaults are
    the Runtime's (``connect`` defaults to ``PoolSettings(max_size=4)``). Validated once, here.

    Attributes:
        min_size: Connections kept open.
        max_size: Connections at most. Under a :class:`~sdcore.Runtime` the job scheduler
            holds at most half of them, so the application's own ``runtime.pool.connection()``
            always finds one.
        application_name: Shown in ``pg_stat_activity``.
        transaction_pooling: The DSN points at a transaction-mode pooler (PgBouncer
            ``pool_mode=transaction``, RDS Proxy, …): no server-side prepared statements.
        connect_timeout: Seconds per connection attempt and host (libpq rules: whole seconds, at
            least 2). ``None``: the DSN's ``connect_timeout``, else 10.
        open_timeout_ms: How long opening waits for the first connection while the server is
            unreachable. A refusal (unknown database or role, failed authentication) fails at once.
        reconnect_min_delay_ms: First pause before retrying to replace a broken connection.
        reconnect_max_delay_ms: The pause doubles up to this.
        reconnect_timeout_ms: Give up replacing a connection after this long (the pool shrinks;
            the next request tries again).

    Raises:
        ValueError: A value out of range (the message names the field and the value).
        TypeError: A value of the wrong type (the same).
    """

    min_size: int = 1
    max_size: int = 10
    application_name: str = "sdcore"
    transaction_pooling: bool = False
    connect_timeout: int | None = None
    open_timeout_ms: int = 30_000
    reconnect_min_delay_ms: int = 100
    reconnect_max_delay_ms: int = 1_000
    reconnect_timeout_ms: int = 300_000

    def __post_init__(self) -> None:
        int_between("min_size", self.min_size, 0, 10_000)
        int_between("max_size", self.max_size, 1, 10_000)
        if self.min_size > self.max_size:
            raise ValueError(
                f"min_size must be at most max_size ({self.max_size}), got {self.min_size}"
            )
        text("application_name", self.application_name, empty=True)
        boolean("transaction_pooling", self.transaction_pooling)
        if self.connect_timeout is not None:
            int_between("connect_timeout", self.connect_timeout, 1, 86_400)
        int_between("open_timeout_ms", self.open_timeout_ms, 0, _INT_MAX)
        int_between("reconnect_min_delay_ms", self.reconnect_min_delay_ms, 1, 600_000)
        int_between("reconnect_max_delay_ms", self.reconnect_max_delay_ms, 1, 600_000)
        if self.reconnect_min_delay_ms > self.reconnect_max_delay_ms:
            raise ValueError(
                "reconnect_min_delay_ms must be at most reconnect_max_delay_ms "
                f"({self.reconnect_max_delay_ms}), got {self.reconnect_min_delay_ms}"
            )
        int_between("reconnect_timeout_ms", self.reconnect_timeout_ms, 1, _INT_MAX)

    def connection_kwargs(self, dsn: str) -> dict[str, Any]:
        """Return the keyword arguments every connection of the pool is opened with."""
        kwargs: dict[str, Any] = {"autocommit": True, "application_name": self.application_name}
        if self.connect_timeout is not None:
            kwargs["connect_timeout"] = self.connect_timeout
        elif "connect_timeout" not in conninfo_to_dict(dsn):
            kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        if self.transaction_pooling:
            # Named prepared statements live in one server session; a transaction-mode pooler
            # hands the next transaction to another one ("prepared statement _pg3_0 does not
            # exist" / "already exists" / "bind message supplies 8 parameters").
            kwargs["prepare_threshold"] = None
        return kwargs


class _CappedBackoff(AttemptWithBackoff):
    """psycopg_pool's reconnect attempt with our first delay and a cap on the doubling."""

    def __init__(self, *, timeout: float, first: float, cap: float) -> None:
        super().__init__(timeout=timeout)
        self._first = first
        self._cap = cap

    def update_delay(self, now: float) -> None:
        if self.delay == 0.0:
            self.give_up_at = now + self.timeout
            self.delay = BasePool._jitter(self._first, -0.1, 0.1)
        else:
            self.delay = min(self.delay * 2, BasePool._jitter(self._cap, -0.1, 0.0))
        if self.delay + now > self.give_up_at:
            self.delay = max(0.0, self.give_up_at - now)


class SdcorePool(AsyncConnectionPool[AsyncConnection[Any]]):
    """An ``AsyncConnectionPool`` with sdcore's reconnect timing; remembers the last failure.

    Build it with :func:`create_pool`; open it with :func:`open_pool`.
    """

    def __init__(self, dsn: str, settings: PoolSettings) -> None:
        super().__init__(
            dsn,
            min_size=settings.min_size,
            max_size=settings.max_size,
            kwargs=settings.connection_kwargs(dsn),
            reconnect_timeout=settings.reconnect_timeout_ms / 1000,
            open=False,
        )
        self.settings = settings
        self.dsn = dsn
        self.last_connect_error: BaseException | None = None

    async def _add_connection(
        self, attempt: AttemptWithBackoff | None, growing: bool = False
    ) -> None:
        if attempt is None:
            attempt = _CappedBackoff(
                timeout=self.reconnect_timeout,
                first=self.settings.reconnect_min_delay_ms / 1000,
                cap=self.settings.reconnect_max_delay_ms / 1000,
            )
        await super()._add_connection(attempt, growing)

    async def _connect(self, timeout: float | None = None) -> AsyncConnection[Any]:  # noqa: ASYNC109
        try:
            conn = await super()._connect(timeout)
        except Exception as exc:
            self.last_connect_error = exc
            raise
        self.last_connect_error = None
        return conn


def create_pool(dsn: str, settings: PoolSettings | None = None) -> SdcorePool:
    """Return a closed pool for ``dsn`` (open it with :func:`open_pool`).

    Args:
        dsn: libpq connection string or URL (multi-host DSNs with ``target_session_attrs=
            read-write`` follow a failover).
        settings: Sizes and timing (default ``PoolSettings()``).

    Returns:
        The pool.

    Raises:
        TypeError: ``dsn`` is not a ``str``, or ``settings`` no :class:`PoolSettings` (the
            message never repeats the DSN).
        ValueError: ``dsn`` cannot be parsed (the message never repeats it).
    """
    if not isinstance(dsn, str):
        raise TypeError("dsn must be a str")
    if settings is not None and not isinstance(settings, PoolSettings):
        raise TypeError(f"settings must be a PoolSettings or None, got {shown(settings)}")
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ValueError("the DSN is not a valid libpq connection string") from None
    return SdcorePool(dsn, settings or PoolSettings())


def _reason(exc: BaseException, dsn: str) -> str:
    text = str(exc).strip() or type(exc).__name__
    return redact_text(text.removeprefix("connection failed: "), dsn)


async def open_pool(pool: SdcorePool) -> None:
    """Open ``pool`` once one connection succeeds, within ``settings.open_timeout_ms``.

    Raises:
        DatabaseConnectError: The server refused (at once), or nothing answered in time; the
            message holds the driver's reason, never the password.
    """
    settings, dsn = pool.settings, pool.dsn
    kwargs = settings.connection_kwargs(dsn)
    deadline = time.monotonic() + settings.open_timeout_ms / 1000
    delay = settings.reconnect_min_delay_ms / 1000
    while True:
        try:
            probe = await AsyncConnection.connect(dsn, **kwargs)
        except psycopg.Error as exc:
            permanent = _PERMANENT.search(str(exc)) is not None
            left = deadline - time.monotonic()
            if permanent or left <= 0:
                raise DatabaseConnectError(
                    dsn=redact_dsn(dsn), reason=_reason(exc, dsn), permanent=permanent
                ) from None
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, settings.reconnect_max_delay_ms / 1000)
            continue
        await probe.close()
        break
    remaining = max(deadline - time.monotonic(), 1.0)
    try:
        await pool.open(wait=True, timeout=math.ceil(remaining))
    except PoolTimeout:
        await pool.close()
        last = pool.last_connect_error
        reason = _reason(last, dsn) if last else f"no connection within {remaining:.0f} s"
        raise DatabaseConnectError(dsn=redact_dsn(dsn), reason=reason, permanent=False) from None
