"""The layering, checked: no upward import, and no package imports another's private module.

Layers, bottom to top (a package may import its own layer's other packages only where listed as
lower): ``_internal``/``_json`` → ``events``/``postgres`` → ``job_scheduler`` →
``scheduling``/``outbox`` → ``queues`` → ``runtime``/``sqlalchemy``/``testing`` →
``fastapi``/``dashboard``/``sync`` → ``cli``/``demo``. Imports inside functions and under
``TYPE_CHECKING`` count too. What two packages share lives in ``sdcore._internal``, the one
private module every package may import. The listed exceptions (``FRIENDS``): the in-memory
doubles of ``sdcore.testing``, ``sdcore.scheduling``, which runs on the lease's tick helpers, and
the alerting scan, which waits for the scheduler's last owner as the sweep does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "sdcore"

LAYERS: dict[str, int] = {
    "_internal": 0,
    "_json": 0,
    "exceptions": 0,
    "jsonlog": 0,
    "events": 1,
    "postgres": 1,
    "job_scheduler": 2,
    "scheduling": 3,
    "outbox": 3,
    "queues": 4,
    "metrics": 4,
    "alerting": 4,
    "tracing": 4,
    "probes": 5,
    "runtime": 5,
    "sqlalchemy": 5,
    "testing": 5,
    "fastapi": 6,
    "dashboard": 6,
    "sync": 6,
    "cli": 7,
    "django": 7,  # a Django app over the runtime and the command line
    "demo": 7,
    "__init__": 8,  # ``sdcore`` itself, which re-exports lazily
}
SHARED_PRIVATE = {"_internal", "_json"}  # "exceptions" is public
# Narrow exceptions, one package and the packages whose private modules it may import:
# - the in-memory doubles are twins of the real backends: they share the backends' private value
#   types and validators so that they cannot drift (the contract suites check the answers);
# - the scheduler is the one user of the lease's tick helpers (``js_trim``, ``resolve_timing``,
#   ``MAX_BACKOFF_MS``), which are therefore not public API.
# - the blocking facade runs the async objects' own statement sequences on a blocking connection
#   (the lease's finalize and admin plans, the outbox's write loop and admin requests, the
#   migration runner) and their own validation: one implementation.
# - the alerting scan judges a tick missed only after its last owner's turn, the bound the
#   sweep uses (``LAST_ASK_S`` of the scheduler's owners), not a copy of it.
FRIENDS = {
    "alerting": {"scheduling"},
    "testing": {"job_scheduler", "outbox", "scheduling"},
    "scheduling": {"job_scheduler"},
    "sync": {"job_scheduler", "outbox", "postgres"},
}
# Upward imports allowed for one release, each for a deprecated call only: Outbox.enqueue_once
# hands a SQLAlchemy session on to sdcore.sqlalchemy.enqueue_once with a DeprecationWarning.
DEPRECATED_UPWARD = {("outbox", "sdcore.sqlalchemy")}


def _package_of(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from sdcore.pkg import _private`` reaches a private module as well.
            found += [
                (node.lineno, f"{node.module}.{alias.name}")
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
    return found


def violations(package: str, source: str, where: str) -> list[str]:
    """The layering violations of one module's source."""
    problems = []
    for line, module in _imports(ast.parse(source)):
        parts = module.split(".")
        if parts[0] != "sdcore" or len(parts) < 2:
            continue
        target = parts[1]
        if target == package:
            continue
        if target not in LAYERS:
            problems.append(f"{where}:{line}: imports {module}, a package not in LAYERS")
            continue
        if LAYERS[target] > LAYERS[package] and (package, module) not in DEPRECATED_UPWARD:
            problems.append(f"{where}:{line}: {package} imports {module} from a higher layer")
        private = [p for p in parts[2:] if p.startswith("_") and not p.startswith("__")]
        if private and target not in SHARED_PRIVATE | FRIENDS.get(package, set()):
            problems.append(f"{where}:{line}: {package} imports {module}, private to {target}")
    return problems


def test_every_package_has_a_layer() -> None:
    packages = {_package_of(path) for path in SRC.rglob("*.py")}
    assert packages - set(LAYERS) == set()


def test_no_upward_or_private_cross_package_import() -> None:
    problems: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        where = str(path.relative_to(SRC.parent))
        problems += violations(_package_of(path), path.read_text(encoding="utf-8"), where)
    assert problems == []


@pytest.mark.parametrize(
    ("package", "source", "expected"),
    [
        ("queues", "from sdcore.job_scheduler._base import error_text", "private to job_scheduler"),
        ("postgres", "import sdcore.scheduling", "from a higher layer"),
        ("outbox", "def f():\n    from sdcore.fastapi import Sdcore", "from a higher layer"),
        ("outbox", "from sdcore.job_scheduler import _options", "private to job_scheduler"),
        ("events", "from sdcore.nowhere import x", "not in LAYERS"),
    ],
    ids=["private", "upward", "lazy-upward", "private-by-name", "unknown"],
)
def test_the_check_catches_what_it_should(package: str, source: str, expected: str) -> None:
    found = violations(package, source, "x.py")
    assert len(found) == 1
    assert expected in found[0]


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("outbox", "from sdcore.job_scheduler import bullmq_job_id"),
        ("queues", "from sdcore._internal.errors import error_text"),
        ("outbox", "from sdcore.outbox._model import X"),
        ("cli", "from sdcore.postgres import redact_text"),
        ("testing", "from sdcore.outbox._store import PostgresOutboxStore"),
    ],
    ids=["public-lower", "internal", "own-private", "cli-down", "testing-friend"],
)
def test_the_check_allows_what_it_should(package: str, source: str) -> None:
    assert violations(package, source, "x.py") == []


# Who may build a connection pool: the pool factory itself, the composition root, and the job
# scheduler's documented convenience ``JobSchedulerService.connect``. Every entry point (CLI,
# demo, FastAPI) gets its pool from a ``Runtime``.
POOL_BUILDERS = {"postgres/_pool.py", "runtime.py", "job_scheduler/_service.py"}
_POOL_CALLS = {"create_pool", "AsyncConnectionPool", "SdcorePool"}


def pool_builds(source: str) -> list[int]:
    """Lines of ``source`` that call ``create_pool`` / ``AsyncConnectionPool`` / ``SdcorePool``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _POOL_CALLS:
                lines.append(node.lineno)
    return lines


def test_only_the_runtime_and_the_pool_factory_build_pools() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where not in POOL_BUILDERS:
            found += [f"{where}:{line}" for line in pool_builds(path.read_text("utf-8"))]
    assert found == [], f"build the pool through a Runtime instead: {found}"


def test_the_pool_check_catches_what_it_should() -> None:
    direct = "from psycopg_pool import AsyncConnectionPool\np = AsyncConnectionPool(d)"
    assert pool_builds(direct) == [2]
    assert pool_builds("import sdcore.postgres as pg\npool = pg.create_pool(dsn, settings)") == [2]
    assert pool_builds("pool: AsyncConnectionPool[Any] = runtime.pool") == []
