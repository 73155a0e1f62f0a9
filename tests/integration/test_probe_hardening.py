"""The monitoring port under hostile input and its default address: oversized requests (a long
line, or a flood of short header lines) get a 431 without an ERROR record, and ``serve()`` /
``sdcore run --metrics-port`` bind the loopback address unless told otherwise (read from the
kernel's socket table of a real process)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdcore.probes import serve
from sdcore.runtime import Runtime
from tests._servers import free_port

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


async def test_oversized_requests_get_431_and_no_error_record(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="sdcore.probes")
    runtime = Runtime(database_url=pg_dsn)  # never started: the probes say so
    port = free_port()
    server = await serve(runtime, port=port)
    try:
        assert server.sockets[0].getsockname()[0] == "127.0.0.1", "loopback by default"
        answers = [
            await _exchange(port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"),
            await _exchange(port, b"GET /livez HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n"),
            await _exchange(port, b"GET /readyz HTTP/1.1\r\n" + b"c" * 100_000),
            # Many short header lines: each under the limit, their number not.
            await _exchange(port, b"GET /livez HTTP/1.1\r\n" + b"a: b\r\n" * 5_000 + b"\r\n"),
        ]
        live = await _exchange(port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        server.close()
        await server.wait_closed()
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert live.startswith(b"HTTP/1.1 503 "), "still serving (the runtime is not started)"
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]
    assert not any(r.exc_info for r in caplog.records)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
            octets = [str(int(address[i : i + 2], 16)) for i in range(6, -1, -2)]
            found.add(".".join(octets))
    return found


@pytest.mark.slow
def test_sdcore_run_binds_the_monitoring_port_to_loopback(pg_dsn: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sdcore.cli",
            "run",
            "tests.integration._run_app:runtime",
            "--metrics-port",
            str(port),
        ],
        cwd=ROOT,
        env={**os.environ, "SDCORE_RUN_TEST_DSN": pg_dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (addresses := _listening_addresses(port)):
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("the monitoring port never listened")
            time.sleep(0.2)
        assert addresses == {"127.0.0.1"}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
