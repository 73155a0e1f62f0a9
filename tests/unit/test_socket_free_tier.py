"""The socket-free tier is enforced: a test here (marked ``memory``) cannot reach a server."""

from __future__ import annotations

import asyncio
import socket

import psycopg
import pytest

from tests.conftest import SocketFreeTestError

DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def test_this_module_is_in_the_socket_free_tier(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("memory") is not None
    assert request.node.get_closest_marker("postgres") is None


@pytest.mark.parametrize(
    "connect",
    [
        lambda: psycopg.connect(DSN),
        lambda: psycopg.Connection.connect(DSN),
        lambda: psycopg.connect("host=/var/run/postgresql dbname=postgres user=postgres"),
    ],
    ids=["psycopg.connect", "Connection.connect", "unix-socket"],
)
def test_psycopg_cannot_connect(connect: object) -> None:
    with pytest.raises(SocketFreeTestError):
        connect()  # type: ignore[operator]


async def test_async_psycopg_cannot_connect() -> None:
    with pytest.raises(SocketFreeTestError):
        await psycopg.AsyncConnection.connect(DSN)


def test_a_tcp_socket_cannot_connect() -> None:
    with pytest.raises(Exception, match="socket"):
        socket.create_connection(("127.0.0.1", 6379), timeout=1)


async def test_asyncio_cannot_open_a_tcp_connection() -> None:
    with pytest.raises(Exception, match="socket"):
        await asyncio.open_connection("127.0.0.1", 6379)
