"""A loopback TCP proxy in front of a broker, to cut its clients' connections on demand.

``cut()`` aborts every connection open now (both ends see a reset, as when a broker node or a
load balancer drops them); while ``refusing`` is set, new connections are closed as soon as they
are accepted (a broker that is down); while ``holding`` is set, nothing is forwarded either way
(a broker that stops reading and answering: a client's writes fill the TCP buffers, then block).
The shared servers are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``host:port``; see the module."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.target_port = port
        self.port = 0
        self.refusing = False
        self.holding = False
        self.accepted = 0
        self._links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def cut(self) -> int:
        """Abort every connection open now; return how many."""
        links, self._links = self._links, []
        for client, server in links:
            client.transport.abort()
            server.transport.abort()
        return len(links)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._links.append((writer, up_writer))
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                while self.holding:
                    await asyncio.sleep(0.02)
                dst.write(data)
                await dst.drain()
        dst.transport.abort()
