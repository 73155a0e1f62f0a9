"""A TCP proxy in front of PostgreSQL that forwards one request and loses its answer.

Once a trip rule matches a client message, that message is still forwarded (so the server runs
and, in autocommit or on ``COMMIT``, commits it); the server's answer up to ReadyForQuery is
swallowed and both sides of that connection are cut. The server did the work; the client never
hears it. Optionally every later answer, on every connection, is delayed, so a client's
recovery (reading the outcome back) is slow enough to be interrupted.

Trip rules are per-connection predicates over the bytes of one client read (``on_message``,
``on_commit_after``); the proxy trips at most once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from psycopg.conninfo import conninfo_to_dict, make_conninfo

READY_FOR_QUERY = b"Z\x00\x00\x00\x05"

Trip = Callable[[bytes], bool]
"""Given the bytes of one client read, ``True`` trips the proxy on it."""

TripRule = Callable[[], Trip]
"""Makes the trip predicate of one client connection (so a rule may keep per-connection state)."""


# An extended-protocol Execute of the unnamed portal, all rows: what psycopg sends to run a
# statement, prepared or not.
EXECUTE = b"E\x00\x00\x00\x09\x00\x00\x00\x00\x00"


def on_message(marker: bytes) -> TripRule:
    """Trip on the first client message that runs a statement holding ``marker``.

    A statement prepared at its first use arrives as a Parse alone, then its Bind and Execute
    (without the text) in the next message: the proxy trips on that one, which runs it.
    """

    def per_connection() -> Trip:
        prepared = False

        def trip(data: bytes) -> bool:
            nonlocal prepared
            if marker in data and data[:1] == b"P" and EXECUTE not in data:
                prepared = True
                return False
            return marker in data or (prepared and EXECUTE in data)

        return trip

    return per_connection


def on_commit_after(marker: bytes) -> TripRule:
    """Trip on the first ``COMMIT`` sent on a connection after it sent a message holding
    ``marker``: the transaction's statements went through, only the commit's reply is lost."""

    def per_connection() -> Trip:
        seen = False

        def trip(data: bytes) -> bool:
            nonlocal seen
            if seen and b"COMMIT" in data:
                return True
            if marker in data:
                seen = True
            return False

        return trip

    return per_connection


class PgProxy:
    """Forward client connections to ``target_dsn``; lose the answer to the message that trips.

    Args:
        target_dsn: The PostgreSQL server to forward to.
        trip: What trips the proxy; ``None`` forwards everything until ``arm`` is called.
        slow_after_trip_s: Once tripped, every server answer (on every connection) waits this
            long before it is forwarded; ``0`` forwards at once.
    """

    def __init__(
        self, target_dsn: str, trip: TripRule | None = None, *, slow_after_trip_s: float = 0.0
    ) -> None:
        params = conninfo_to_dict(target_dsn)
        self.host = str(params.get("host") or "127.0.0.1")
        self.port = int(params.get("port") or 5432)
        self.target_dsn = target_dsn
        self.slow_after_trip_s = slow_after_trip_s
        self.tripped = False
        self.swallowed = asyncio.Event()
        self.listen_port = 0
        self._trip = trip
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.WriteTransport] = set()

    def arm(self, trip: TripRule) -> None:
        """Trip on ``trip`` from now on (messages already forwarded are not looked at again)."""
        self._trip = trip

    @property
    def dsn(self) -> str:
        """The target's DSN with the proxy's address."""
        params = {k: str(v) for k, v in conninfo_to_dict(self.target_dsn).items()}
        params.update(host="127.0.0.1", port=str(self.listen_port), sslmode="disable")
        return make_conninfo(**params)

    async def __aenter__(self) -> PgProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for transport in list(self._transports):
            transport.abort()
        await self._server.wait_closed()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._transports.add(cwriter.transport)
        try:
            sreader, swriter = await asyncio.open_connection(self.host, self.port)
        except OSError:
            cwriter.transport.abort()
            return
        self._transports.add(swriter.transport)
        cut = asyncio.Event()

        async def upstream() -> None:
            trip: Trip | None = None
            rule: TripRule | None = None
            while data := await creader.read(65536):
                if self._trip is not None and not self.tripped:
                    if rule is not self._trip:
                        rule, trip = self._trip, self._trip()
                    assert trip is not None
                    if trip(data):
                        self.tripped = True
                        cut.set()  # set before forwarding: the answer cannot overtake it
                swriter.write(data)
                await swriter.drain()
            swriter.close()

        async def downstream() -> None:
            swallowed = b""
            while data := await sreader.read(65536):
                if cut.is_set():
                    swallowed += data
                    if READY_FOR_QUERY in swallowed:
                        self.swallowed.set()
                        cwriter.transport.abort()
                        swriter.transport.abort()
                        return
                    continue
                if self.tripped and self.slow_after_trip_s:
                    await asyncio.sleep(self.slow_after_trip_s)
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        try:
            await asyncio.gather(upstream(), downstream(), return_exceptions=True)
        finally:
            cwriter.transport.abort()
            swriter.transport.abort()
            self._transports.discard(cwriter.transport)
            self._transports.discard(swriter.transport)
