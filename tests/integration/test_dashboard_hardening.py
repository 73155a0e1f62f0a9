"""The dashboard under hostile input: body size (a real server's peak memory), Host names, the
cookie behind a TLS proxy, sign-out, weak tokens and sign-in guessing, query parameters, the
queues page's cost in Redis (a Redis of our own), and where the secrets come from."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from psycopg_pool import AsyncConnectionPool

from sdcore.dashboard import DashboardError, dashboard_app
from tests._servers import free_port

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hardening-token-Zq8v3XkP0aLm"
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
MB = 1024 * 1024


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "SDCORE_DASHBOARD_TOKEN")
    }
    return {**env, **extra}


@contextmanager
def dashboard_process(
    *args: str, env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``sdcore dashboard`` in a process of its own, until it accepts connections."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdcore.cli", "dashboard", "--port", str(port), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"the dashboard exited: {out} {err}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the dashboard did not listen within 60 s")
                time.sleep(0.1)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()  # reaps it and closes the pipes
            proc.communicate()


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (``VmHWM``), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert found, status
    return int(found.group(1)) / 1024


def post_huge(url: str, path: str, *, size: int, chunked: bool) -> str:
    """POST ``size`` bytes as fast as the server takes them; the status line, or ``""`` when
    the server closed the connection before its answer could be read."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    head += "Content-Type: application/x-www-form-urlencoded\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {size}\r\n\r\n"
    block = b"a" * MB
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(head.encode("ascii"))
            for _ in range(size // MB):
                sock.sendall(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # refused early: the server closed its end
        try:
            return sock.recv(200).decode("latin-1").split("\r\n", 1)[0]
        except OSError:
            return ""


# --- N1, N3, N4: a real server process ----------------------------------------------------------


def test_huge_bodies_are_refused_unread_by_the_server(pg_dsn: str) -> None:
    env = _env(DATABASE_URL=pg_dsn, SDCORE_DASHBOARD_TOKEN=TOKEN)
    with dashboard_process(env=env) as (proc, url):
        assert httpx.get(f"{url}/login", timeout=30).status_code == 200
        before = peak_rss_mb(proc.pid)
        statuses = [
            post_huge(url, "/login", size=100 * MB, chunked=False),
            post_huge(url, "/logout", size=100 * MB, chunked=True),
            post_huge(url, "/nowhere", size=50 * MB, chunked=True),
        ]
        grown = peak_rss_mb(proc.pid) - before
        assert grown < 40, f"peak RSS grew by {grown:.0f} MiB for 250 MB of bodies ({statuses})"
        assert statuses[0] in ("HTTP/1.1 413 Request Entity Too Large", "HTTP/1.1 413 "), statuses
        # Just over the limit, declared or chunked: a 413 with the security headers.
        over = httpx.post(f"{url}/login", content=b"a" * 16_385, timeout=30)
        assert over.status_code == 413
        assert "frame-ancestors 'none'" in over.headers["content-security-policy"]

        def chunks() -> Iterator[bytes]:
            yield b"a" * 10_000
            yield b"a" * 10_000

        chunked = httpx.post(f"{url}/login", content=chunks(), timeout=30)
        assert chunked.status_code == 413
        assert httpx.get(f"{url}/login", timeout=30).status_code == 200, "still serving"


def test_only_loopback_names_and_allowed_hosts_are_served(pg_dsn: str) -> None:
    env = _env(DATABASE_URL=pg_dsn)
    with dashboard_process("--allowed-host", "dash.example.com", env=env) as (_, url):
        port = url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "dash.example.com"):
            assert httpx.get(f"{url}/outbox", headers={"Host": host}).status_code == 200, host
        rebound = httpx.get(f"{url}/outbox", headers={"Host": f"rebind.evil.example:{port}"})
        assert rebound.status_code == 400
        assert "allowed" in rebound.text
        assert rebound.headers["x-frame-options"] == "DENY"
        assert "server" not in rebound.headers


def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(pg_dsn: str) -> None:
    env = _env(DATABASE_URL=pg_dsn, SDCORE_DASHBOARD_TOKEN=TOKEN)
    proxy = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}
    with (
        dashboard_process("--forwarded-allow-ips", "127.0.0.1", env=env) as (_, url),
        httpx.Client(base_url=url, headers=proxy) as client,
    ):
        page = client.get("/login")
        assert "Secure" in page.headers["set-cookie"]
        found = CSRF.search(page.text)
        assert found
        # httpx keeps a Secure cookie for https only: send it by hand, as the proxy would.
        cookie = page.headers["set-cookie"].split(";", 1)[0]
        r = client.post(
            "/login",
            data={"name": "ops", "token": TOKEN, "csrf": found.group(1)},
            headers={"Cookie": cookie},
        )
        assert r.status_code == 303, r.text
        assert "Secure" in r.headers["set-cookie"]
        assert "HttpOnly" in r.headers["set-cookie"]


# --- N2: secrets from the environment or files, never argv ------------------------------------


def test_urls_come_from_the_environment_or_files(pg_dsn: str, tmp_path: Path) -> None:
    prefix = f"sdtest-none-{os.getpid()}"
    redis_url = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    env = _env(DATABASE_URL=pg_dsn, REDIS_URL=redis_url)
    with dashboard_process("--queue-prefix", prefix, env=env) as (_, url):
        page = httpx.get(f"{url}/queues", timeout=30).text
        assert "No Redis is configured" not in page
        assert "No BullMQ queue found under this prefix" in page

    (tmp_path / "db").write_text(pg_dsn + "\n")
    (tmp_path / "redis").write_text(redis_url + "\n")
    files = [
        "--database-url-file",
        str(tmp_path / "db"),
        "--redis-url-file",
        str(tmp_path / "redis"),
    ]
    with dashboard_process("--queue-prefix", prefix, *files, env=_env()) as (proc, url):
        page = httpx.get(f"{url}/queues", timeout=30).text
        assert "No BullMQ queue found under this prefix" in page
        assert httpx.get(f"{url}/outbox", timeout=30).status_code == 200
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert pg_dsn not in argv
        assert redis_url not in argv


def test_a_password_on_the_command_line_is_warned_about() -> None:
    port = free_port()  # nothing listens there: the command fails after its warnings
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdcore.cli",
            "dashboard",
            "--database-url",
            f"postgresql://app:S3cret-pg@127.0.0.1:{port}/app?connect_timeout=2",
            "--redis-url",
            "redis://:S3cret-redis@127.0.0.1:1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "warning: --database-url holds a password" in done.stderr
    assert "warning: --redis-url holds a password" in done.stderr
    assert "S3cret" not in done.stderr
    unread = subprocess.run(
        [sys.executable, "-m", "sdcore.cli", "dashboard", "--redis-url-file", "/nonexistent/x"],
        cwd=ROOT,
        env=_env(DATABASE_URL="postgresql://127.0.0.1:1/x"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unread.returncode == 2
    assert "--redis-url-file: cannot read '/nonexistent/x'" in unread.stderr


# --- ASGI: mounted, sessions, tokens, parameters ------------------------------------------------


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, open=False) as opened:
        yield opened  # opened by the "async with"


def _client(app: object) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")


async def test_a_mounted_dashboard_reads_no_more_than_its_limit(
    pool: AsyncConnectionPool,
) -> None:
    host = FastAPI()
    host.mount("/ops", dashboard_app(pool, token=TOKEN))
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(20 * MB // 65_536):
            pulled += 65_536
            yield b"a" * 65_536

    async with _client(host) as client:
        for path in ("/login", "/logout", "/schedule/pause", "/outbox/retry", "/nope", "/static/x"):
            pulled = 0
            r = await client.post(f"/ops{path}", content=body())
            assert r.status_code == 413, (path, r.status_code)
            assert pulled <= 16_384 + 65_536, (path, pulled)
            assert r.headers["x-content-type-options"] == "nosniff"


async def _sign_in(client: httpx.AsyncClient, token: str = TOKEN) -> httpx.Response:
    page = await client.get("/login")
    found = CSRF.search(page.text)
    assert found, page.text
    return await client.post("/login", data={"name": "alice", "token": token, "csrf": found[1]})


async def test_sign_out_ends_the_session_on_the_server(pool: AsyncConnectionPool) -> None:
    app = dashboard_app(pool, token=TOKEN)
    async with _client(app) as alice:
        assert (await _sign_in(alice)).status_code == 303
        page = await alice.get("/outbox")
        assert "operator: <strong>alice</strong>" in page.text
        copied = alice.cookies["sdcore_dashboard"]
        csrf = CSRF.search(page.text)
        assert csrf
        r = await alice.post("/logout", data={"csrf": csrf[1]})
        assert r.status_code == 303
    async with _client(app) as thief:
        thief.cookies.set("sdcore_dashboard", copied)
        page = await thief.get("/outbox")
        assert "operator:" not in page.text, "a copy of the signed-out cookie still acts"
        r = await thief.post("/outbox/retry", data={"id": "1", "csrf": csrf[1]})
        assert r.status_code == 401


async def test_signing_in_again_ends_the_session_it_replaces(pool: AsyncConnectionPool) -> None:
    app = dashboard_app(pool, token=TOKEN)
    async with _client(app) as alice:
        assert (await _sign_in(alice)).status_code == 303
        copied = alice.cookies["sdcore_dashboard"]
        assert (await _sign_in(alice)).status_code == 303  # e.g. to change the name shown
        assert alice.cookies["sdcore_dashboard"] != copied
        page = await alice.get("/outbox")
        csrf = CSRF.search(page.text)
        assert csrf
        assert (await alice.post("/logout", data={"csrf": csrf[1]})).status_code == 303
    async with _client(app) as thief:
        thief.cookies.set("sdcore_dashboard", copied)
        page = await thief.get("/outbox")
        assert "operator:" not in page.text, "the session replaced at sign-in still acts"


async def test_rotating_the_token_ends_sessions_when_a_secret_is_given_too(
    pool: AsyncConnectionPool,
) -> None:
    secret = b"replicas-share-this-key-0123456789"
    before = dashboard_app(pool, token=TOKEN, secret=secret)
    async with _client(before) as alice:
        assert (await _sign_in(alice)).status_code == 303
        cookie = alice.cookies["sdcore_dashboard"]
    again = dashboard_app(pool, token=TOKEN, secret=secret)  # another replica, same settings
    rotated = dashboard_app(pool, token="rotated-token-Vb7nQ2xLw9Rk", secret=secret)
    for app, acts in ((again, True), (rotated, False)):
        async with _client(app) as thief:
            thief.cookies.set("sdcore_dashboard", cookie)
            page = await thief.get("/outbox")
            assert ("operator: <strong>alice</strong>" in page.text) is acts, acts


@pytest.mark.parametrize(
    "token",
    ["a" * 16, "password12345678", "changemechangeme", "0" * 16, "abababababababababab"],
    ids=["repeated", "password", "changeme", "zeros", "two-letters"],
)
async def test_predictable_tokens_are_refused(pool: AsyncConnectionPool, token: str) -> None:
    with pytest.raises(DashboardError, match="too predictable"):
        dashboard_app(pool, token=token)


async def test_wrong_sign_ins_are_throttled(
    pool: AsyncConnectionPool, caplog: pytest.LogCaptureFixture
) -> None:
    app = dashboard_app(pool, token=TOKEN)
    caplog.set_level(logging.WARNING, logger="sdcore.dashboard")
    async with _client(app) as guesser:
        codes = [
            (await _sign_in(guesser, f"guess-{n:04d}-Zq8v3XkP")).status_code for n in range(30)
        ]
        assert codes[:10] == [401] * 10
        assert set(codes[10:]) == {429}
        r = await _sign_in(guesser)
        assert r.status_code == 429, "the right token is refused too until the window passes"
        assert int(r.headers["retry-after"]) > 0
    refused = [rec for rec in caplog.records if "was refused" in rec.getMessage()]
    assert refused
    assert "127.0.0.1" in refused[0].getMessage()


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/", {"page": "1000000"}),
        ("/", {"page": "10000000000000000000000"}),
        ("/", {"page": "1" + "0" * 5000}),
        ("/", {"q": "a\x00b"}),
        ("/schedule", {"name": "a\x00b"}),
        ("/outbox", {"status": "\x00"}),
    ],
    ids=["page-1e6", "page-1e22", "page-5001-digits", "q-nul", "name-nul", "status-nul"],
)
async def test_bad_parameters_get_400_with_the_headers(
    pool: AsyncConnectionPool, path: str, params: dict[str, str]
) -> None:
    async with _client(dashboard_app(pool)) as client:
        r = await client.get(path, params=params)
    assert r.status_code == 400, r.text[:200]
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"


async def test_an_unexpected_error_is_a_500_with_the_headers(
    pool: AsyncConnectionPool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    await pool.close()  # every read now fails with an error no page expects
    async with _client(dashboard_app(pool)) as client:
        r = await client.get("/leases")
    assert r.status_code == 500
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1, [rec.getMessage() for rec in errors]


# --- N7: /queues and SCAN -----------------------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)", pytrace=False)
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the test's redis-server did not start", pytrace=False)
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=10)


async def test_queue_views_do_not_scan_the_keyspace_each_time(
    pool: AsyncConnectionPool, own_redis: str
) -> None:
    from redis.asyncio import Redis

    async with Redis.from_url(own_redis) as redis:
        async with redis.pipeline(transaction=False) as pipe:
            for n in range(30_000):
                pipe.hset(f"bull:mails:{n}", "name", "x")
            pipe.hset("bull:mails:meta", "version", "x")
            pipe.rpush("bull:mails:wait", "1", "2")
            pipe.zadd("bull:other:completed", {"1": 1})
            await pipe.execute()

        async def scans() -> int:
            stats = await redis.info("commandstats")
            return int(stats.get("cmdstat_scan", {}).get("calls", 0))

        app = dashboard_app(pool, redis_url=own_redis)
        before = await scans()
        async with _client(app) as client:
            pages = [(await client.get("/queues")).text for _ in range(4)]
        used = await scans() - before
    assert all("mails" in page and "other" in page for page in pages)
    assert ">2<" in pages[-1], "the wait list's length"
    # One walk of 30,000 keys at COUNT 1000 is about 30 calls; five per view were 600.
    assert used <= 45, f"{used} SCAN calls for 4 views"


async def test_a_burst_of_queue_views_shares_one_redis_connection(
    pool: AsyncConnectionPool, own_redis: str
) -> None:
    from redis.asyncio import Redis

    async with Redis.from_url(own_redis) as redis:
        async with redis.pipeline(transaction=False) as pipe:
            for n in range(20):
                pipe.hset(f"bull:q{n}:meta", "version", "x")
                pipe.rpush(f"bull:q{n}:wait", "1")
            await pipe.execute()

        async def stats() -> tuple[int, int]:
            info = await redis.info("stats")
            return int(info["total_connections_received"]), int(info["total_commands_processed"])

        app = dashboard_app(pool, redis_url=own_redis)
        async with _client(app) as client:
            assert "q19" in (await client.get("/queues")).text  # the names are walked once
            connections, commands = await stats()
            pages = await asyncio.gather(*(client.get("/queues") for _ in range(50)))
            after = await stats()
    assert all(page.status_code == 200 and "q19" in page.text for page in pages)
    # A view of its own per request would open a connection and send 7 commands per queue (50
    # and about 7,000 here); the burst shares one read, or two if it spans the 2 s lifetime.
    assert after[0] - connections <= 3, f"{after[0] - connections} Redis connections"
    assert after[1] - commands <= 3 * (7 * 20 + 10), f"{after[1] - commands} commands"


async def test_a_missing_lease_table_is_a_notice_not_a_500(pool: AsyncConnectionPool) -> None:
    async with _client(dashboard_app(pool)) as client:
        r = await client.get("/leases")
    assert r.status_code == 200
    assert "The lease table does not exist" in r.text
