"""Own, throw-away servers for tests that must break or proxy one: PgBouncer, PostgreSQL, Redis.

Every server listens on a free loopback port, lives in a temporary directory and is removed at
the end. Debian's ``pgbouncer`` refuses to run as root and ``initdb`` too, so as root both run as
the ``postgres`` OS user. The shared PostgreSQL on 5432 is never reconfigured: a PgBouncer in front
of it only forwards connections.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis

PG_BIN = Path(os.environ.get("SDCORE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
SERVICE_USER = "postgres"


def free_port() -> int:
    """Return a loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_service_user() -> dict[str, Any]:
    """``subprocess`` arguments that drop root to the postgres OS user (nothing otherwise)."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(SERVICE_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _workdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(SERVICE_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(0o700)
    return path


def run(cmd: Sequence[str], *, timeout: float = 60, check: bool = True) -> str:
    """Run a server tool as the service user; return its output (stdout and stderr)."""
    done = subprocess.run(
        list(cmd),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        **_as_service_user(),
    )
    out = str(done.stdout) + str(done.stderr)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {out[-2000:]}")
    return out


def wait_until_accepting(dsn: str, *, timeout: float = 30) -> None:
    """Poll ``dsn`` until a connection succeeds (a deadline, never forever)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=2, autocommit=True):
                return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"server at {dsn} did not accept connections: {exc}") from exc
            time.sleep(0.1)


# --------------------------------------------------------------------------------- PgBouncer


@dataclass
class PgBouncer:
    """A running PgBouncer forwarding every database name to one PostgreSQL."""

    port: int
    mode: str
    workdir: Path
    process: subprocess.Popen[bytes]

    def dsn(self, dbname: str, user: str = "postgres") -> str:
        """A DSN for ``dbname`` through this PgBouncer."""
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user}"

    @property
    def log(self) -> str:
        """PgBouncer's log so far."""
        path = self.workdir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


def pgbouncer_binary() -> str:
    """The ``pgbouncer`` executable, or a test failure saying how to get it."""
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).exists()), None
    )
    if found is None:
        pytest.fail(
            "pgbouncer is not installed: apt-get install pgbouncer (.ci/run does it)",
            pytrace=False,
        )
    return found


@contextlib.contextmanager
def pgbouncer(
    *, upstream_host: str, upstream_port: int, mode: str, pool_size: int
) -> Iterator[PgBouncer]:
    """Start a PgBouncer (``pool_mode = mode``) in front of ``upstream``; stop and remove it."""
    binary = pgbouncer_binary()
    workdir = _workdir("sdcore-pgbouncer-")
    port = free_port()
    (workdir / "users.txt").write_text('"postgres" ""\n')
    (workdir / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={upstream_host} port={upstream_port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {workdir / 'users.txt'}",
                f"pool_mode = {mode}",
                f"default_pool_size = {pool_size}",
                "min_pool_size = 0",
                "reserve_pool_size = 0",
                "max_client_conn = 500",
                "server_lifetime = 3600",
                "server_idle_timeout = 600",
                f"logfile = {workdir / 'pgbouncer.log'}",
                "log_connections = 0",
                "log_disconnections = 0",
                "admin_users = postgres",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        entry = pwd.getpwnam(SERVICE_USER)
        for name in ("users.txt", "pgbouncer.ini"):
            os.chown(workdir / name, entry.pw_uid, entry.pw_gid)
    process = subprocess.Popen(
        [binary, str(workdir / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        **_as_service_user(),
    )
    server = PgBouncer(port=port, mode=mode, workdir=workdir, process=process)
    try:
        wait_until_accepting(server.dsn("pgbouncer"), timeout=20)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# -------------------------------------------------------------------------------- PostgreSQL


@dataclass
class Postgres:
    """One PostgreSQL instance of our own (primary or standby)."""

    name: str
    port: int
    datadir: Path
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        """A DSN for the ``postgres`` database of this instance."""
        return f"host=127.0.0.1 port={self.port} dbname=postgres user=postgres"

    def pg_ctl(self, *args: str, timeout: float = 60) -> str:
        """Run ``pg_ctl -D datadir …``."""
        return run([str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), *args], timeout=timeout)

    def start(self) -> None:
        """Start and wait until it accepts connections."""
        self.pg_ctl("-l", str(self.datadir / "server.log"), "-w", "-t", "60", "start")
        wait_until_accepting(self.dsn)

    def crash(self) -> None:
        """Stop without a shutdown checkpoint, like a crash (``pg_ctl -m immediate``)."""
        self.pg_ctl("-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        """Stop if running (fast); never raises."""
        with contextlib.suppress(Exception):
            self.pg_ctl("-m", "immediate", "-w", "stop", timeout=30)

    @property
    def log(self) -> str:
        """The server log so far."""
        path = self.datadir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _configure(server: Postgres, extra: dict[str, str]) -> None:
    settings = {
        "listen_addresses": "'127.0.0.1'",
        "port": str(server.port),
        "unix_socket_directories": f"'{server.datadir}'",
        "max_connections": "40",
        "shared_buffers": "16MB",
        "wal_level": "replica",
        "max_wal_senders": "5",
        "hot_standby": "on",
        "wal_keep_size": "64MB",
        "fsync": "off",  # an OS crash is not simulated; pg_ctl -m immediate is
        "logging_collector": "off",
        **extra,
    }
    server.settings = settings
    conf = server.datadir / "postgresql.auto.conf"
    lines = [f"{name} = {value}" for name, value in settings.items()]
    with conf.open("a") as handle:
        handle.write("\n" + "\n".join(lines) + "\n")


@contextlib.contextmanager
def own_postgres(settings: dict[str, str] | None = None) -> Iterator[Postgres]:
    """One throw-away PostgreSQL on a free loopback port, with ``settings`` on top of ours.

    For benchmarks that need a server of their own (``shared_preload_libraries``, statement
    logging); removed at the end. ``fsync`` is off unless ``settings`` turns it on.
    """
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"PostgreSQL server binaries not found in {PG_BIN}")
    root = _workdir("sdcore-own-pg-")
    server = Postgres(name="own", port=free_port(), datadir=root / "data")
    try:
        run(
            [str(PG_BIN / "initdb"), "-D", str(server.datadir), "-U", "postgres",
             "--auth=trust", "--no-sync", "-E", "UTF8"]
        )  # fmt: skip
        _configure(server, settings or {})
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def replicated_pair(*, synchronous: bool) -> Iterator[tuple[Postgres, Postgres]]:
    """A primary and a streaming standby (``pg_basebackup -R``) on free loopback ports.

    With ``synchronous`` the primary waits for the standby's flush before a commit returns
    (``synchronous_standby_names = 'standby1'``). Both are removed at the end.
    """
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL server binaries not found in {PG_BIN}", pytrace=False)
    root = _workdir("sdcore-failover-")
    primary = Postgres(name="primary", port=free_port(), datadir=root / "primary")
    standby = Postgres(name="standby", port=free_port(), datadir=root / "standby")
    try:
        run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(primary.datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ]
        )
        _configure(
            primary,
            {"synchronous_standby_names": "'standby1'" if synchronous else "''"},
        )
        primary.start()
        run(
            [
                str(PG_BIN / "pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                "postgres",
                "-D",
                str(standby.datadir),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ]
        )
        # pg_basebackup copied the primary's synchronous_standby_names: once promoted, the
        # standby would wait for a synchronous standby of its own, and every commit would hang.
        _configure(standby, {"cluster_name": "'standby1'", "synchronous_standby_names": "''"})
        standby.datadir.chmod(0o700)
        standby.start()
        _wait_streaming(primary, synchronous=synchronous)
        yield primary, standby
    finally:
        standby.stop()
        primary.stop()
        shutil.rmtree(root, ignore_errors=True)


def _wait_streaming(primary: Postgres, *, synchronous: bool, timeout: float = 30) -> None:
    want = "sync" if synchronous else "async"
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT application_name, state, sync_state FROM pg_stat_replication"
            ).fetchall()
        if any(r[0] == "standby1" and r[1] == "streaming" and r[2] == want for r in rows):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"standby not streaming ({want}): {rows}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------- Redis


class RedisServer:
    """A redis-server of one test alone, on a spare loopback port, crashable and restartable.

    ``durable`` turns on AOF with ``appendfsync always``, so a write Redis acknowledged survives
    a ``kill -9``; otherwise nothing is persisted (the data is disposable).
    """

    def __init__(
        self, directory: Path, *, durable: bool = False, extra: Sequence[str] = ()
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed (apt-get install redis-server)", pytrace=False
            )
        self.binary = binary
        self.directory = directory
        self.durable = durable
        self.extra = tuple(extra)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it (again, on the same port and directory) and wait until it accepts.

        Ready means this process logged that it accepts connections: a port that merely
        accepts may be another server's (a cluster node's bus port is its port + 10000, which
        ``free_port`` cannot see coming). At a cluster node's first start, a port taken
        meanwhile is replaced by a new one; a restart keeps its port (clients know it).
        """
        # Only a cluster node's port moves: a replica's options name its master's port.
        movable = not self._started and "--cluster-enabled" in self.extra
        for _ in range(5):
            if self._start_once():
                self._started = True
                return
            if not movable:
                break
            self.port = _cluster_port()
        pytest.fail("private redis-server did not start", pytrace=False)

    def _start_once(self) -> bool:
        persistence = (
            ("--appendonly", "yes", "--appendfsync", "always")
            if self.durable
            else ("--appendonly", "no")
        )
        log = self.directory / "redis.log"
        seen = log.stat().st_size if log.exists() else 0
        self.proc = subprocess.Popen(
            [
                *(self.binary, "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", *persistence),
                *("--dir", str(self.directory), "--logfile", str(log)),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False  # exited: the port is taken (or a bad option)
            if log.exists():
                with log.open("rb") as handle:
                    handle.seek(seen)
                    if b"Ready to accept connections" in handle.read():
                        return True
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None
        return False

    def crash(self) -> None:
        """``kill -9`` it (SIGTERM may wait for an AOF rewrite); a no-op when it is not running."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@contextlib.contextmanager
def redis_server(directory: Path, *, durable: bool = False) -> Iterator[RedisServer]:
    """A started ``RedisServer`` in ``directory``, killed at the end."""
    server = RedisServer(directory, durable=durable)
    try:
        server.start()
        yield server
    finally:
        server.crash()


class SentinelGroup:
    """A Redis master, its replicas and three sentinels of one test alone, on spare loopback ports.

    The sentinels watch the master as ``service`` with a quorum of two, call a node down after
    ``down_after_ms`` without a reply and give a failover ``failover_timeout_ms``. ``url`` is the
    ``redis+sentinel://`` URL of the group.
    """

    def __init__(
        self,
        directory: Path,
        *,
        replicas: int = 1,
        service: str = "mymaster",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        node_options: Sequence[str] = (),
    ) -> None:
        self.directory = directory
        self.service = service
        # Diskless sync without delay: a demoted master resyncs from the new one in milliseconds.
        common = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0", *node_options)
        first = directory / "node-0"
        first.mkdir()
        self.nodes = [RedisServer(first, extra=common)]
        for index in range(1, replicas + 1):
            path = directory / f"node-{index}"
            path.mkdir()
            replicaof = ("--replicaof", "127.0.0.1", str(self.nodes[0].port))
            self.nodes.append(RedisServer(path, extra=(*common, *replicaof)))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self._sentinels: list[subprocess.Popen[bytes]] = []
        self._down_after_ms = down_after_ms
        self._failover_timeout_ms = failover_timeout_ms

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self) -> None:
        """Start the nodes, wait until every replica is in sync, then start the sentinels."""
        for node in self.nodes:
            node.start()
        self.wait_synced(self.nodes[0].port, len(self.nodes) - 1)
        binary = self.nodes[0].binary
        for index, port in enumerate(self.sentinel_ports):
            conf = self.directory / f"sentinel-{index}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"logfile {self.directory / f'sentinel-{index}.log'}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.nodes[0].port} 2\n"
                f"sentinel down-after-milliseconds {self.service} {self._down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {self._failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
            self._sentinels.append(
                subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
            )
        deadline = time.monotonic() + 30
        # Ready once every sentinel knows the replicas and the other sentinels (a failover
        # needs both).
        while not all(self._sentinel_ready(port) for port in self.sentinel_ports):
            if time.monotonic() > deadline:
                pytest.fail("private sentinels did not discover each other", pytrace=False)
            time.sleep(0.1)

    def _sentinel_ready(self, port: int) -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
                fields = client.sentinel_master(self.service)
        except (redis.RedisError, OSError):
            return False
        want_replicas = len(self.nodes) - 1
        return (
            int(fields["num-slaves"]) >= want_replicas and int(fields["num-other-sentinels"]) == 2
        )

    def master_port(self) -> int:
        """The master's port, as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
                    address = client.sentinel_get_master_addr_by_name(self.service)
            except (redis.RedisError, OSError):
                continue
            return int(address[1])
        raise RuntimeError("no sentinel answers")

    def failover(self) -> None:
        """``SENTINEL FAILOVER``: promote a replica without waiting for the master to fail."""
        with redis.Redis(port=self.sentinel_ports[0], socket_timeout=5) as client:
            client.execute_command("SENTINEL", "FAILOVER", self.service)

    def wait_synced(self, master_port: int, replicas: int, *, timeout: float = 30) -> None:
        """Wait until ``master_port`` has ``replicas`` replicas online, none lagging behind."""
        deadline = time.monotonic() + timeout
        with redis.Redis(port=master_port, socket_timeout=1, decode_responses=True) as client:
            while True:
                info = client.info("replication")
                offset = int(info.get("master_repl_offset", 0))
                online = [
                    value
                    for key, value in info.items()
                    if key.startswith("slave")
                    and isinstance(value, dict)
                    and value.get("state") == "online"
                ]
                if len(online) >= replicas and all(int(v["offset"]) >= offset for v in online):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replicas not in sync: {info}")
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill every process of the group."""
        for proc in self._sentinels:
            proc.kill()
            proc.wait(10)
        self._sentinels.clear()
        for node in self.nodes:
            node.crash()


_Group = TypeVar("_Group", "SentinelGroup", "RedisClusterGroup")


@contextlib.contextmanager
def _started(make: Callable[[Path], _Group], prefix: str) -> Iterator[_Group]:
    """A group built in a new temporary directory, started; killed and removed at the end."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    group = make(directory)
    try:
        group.start()
        yield group
    finally:
        group.stop()
        shutil.rmtree(directory, ignore_errors=True)


def sentinel_group(**options: Any) -> contextlib.AbstractContextManager[SentinelGroup]:
    """A started :class:`SentinelGroup` in a temporary directory, killed and removed at the end."""
    return _started(lambda directory: SentinelGroup(directory, **options), "sdcore-sentinel-")


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (the port + 10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterGroup:
    """A Redis Cluster of one test alone: ``masters`` masters, ``replicas`` replicas each.

    Every node is a :class:`RedisServer` in cluster mode on a spare loopback port, its
    ``nodes.conf`` in its own directory; ``redis-cli --cluster create`` spreads the 16384 slots
    over the masters and attaches the replicas. ``url`` is the ``redis+cluster://`` URL of the
    masters. ``node_timeout_ms`` is ``cluster-node-timeout``: how long a silent master takes to
    be failed over.
    """

    def __init__(
        self,
        directory: Path,
        *,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 2000,
        node_options: Sequence[str] = (),
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.directory = directory
        self.replicas = replicas
        common = (
            *("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms)),
            *("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"),
            *node_options,
        )
        self.nodes: list[RedisServer] = []
        for index in range(masters * (replicas + 1)):
            path = directory / f"node-{index}"
            path.mkdir()
            node = RedisServer(path, extra=common)
            node.port = _cluster_port()
            self.nodes.append(node)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"redis+cluster://{hosts}"

    def start(self) -> None:
        """Start the nodes, create the cluster and wait until every node reports it ``ok``."""
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.fail("redis-cli is not installed (apt-get install redis-tools)", pytrace=False)
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        done = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas),
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}")
        self.wait_ok()

    def wait_ok(self, *, timeout: float = 30) -> None:
        """Wait until every running node says ``cluster_state:ok`` and knows every node."""
        deadline = time.monotonic() + timeout
        while not all(self._ok(node.port) for node in self.nodes if node.proc is not None):
            if time.monotonic() > deadline:
                raise RuntimeError("the private Redis Cluster did not become ok")
            time.sleep(0.1)

    def _ok(self, port: int) -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
                info = str(client.execute_command("CLUSTER", "INFO"))
                nodes = str(client.execute_command("CLUSTER", "NODES"))
        except (redis.RedisError, OSError):
            return False
        known = len([line for line in nodes.splitlines() if line.strip()])
        return "cluster_state:ok" in info and known == len(self.nodes)

    def owner_of(self, key: str) -> int:
        """The port of the master that serves ``key``'s slot now."""
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                with redis.Redis(port=node.port, socket_timeout=1) as client:
                    slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
                    for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                        if int(start) <= slot <= int(end):
                            return int(master[1])
            except (redis.RedisError, OSError):
                continue
        raise RuntimeError("no cluster node answers")

    def replica_of(self, master_port: int) -> int:
        """The port of a replica of the master on ``master_port``."""
        with redis.Redis(port=master_port, socket_timeout=1, decode_responses=True) as client:
            info = client.info("replication")
        for key, value in info.items():
            if key.startswith("slave") and isinstance(value, dict):
                return int(value["port"])
        raise RuntimeError(f"the master on {master_port} has no replica")

    def failover(self, replica_port: int) -> None:
        """``CLUSTER FAILOVER`` on a replica: it and its master swap roles, no write lost."""
        with redis.Redis(port=replica_port, socket_timeout=5) as client:
            client.execute_command("CLUSTER", "FAILOVER")

    def stop(self) -> None:
        """Kill every node."""
        for node in self.nodes:
            node.crash()


def redis_cluster(**options: Any) -> contextlib.AbstractContextManager[RedisClusterGroup]:
    """A started :class:`RedisClusterGroup` in a temporary directory, killed and removed after."""
    return _started(lambda directory: RedisClusterGroup(directory, **options), "sdcore-cluster-")
