"""Run by an installed wheel's interpreter: the package finds its own data where it is installed.

``python _wheel_probe.py EXPECTED.json`` where the file names, relative to the ``sdcore`` package,
every data file of the checkout (``files``), the named-SQL files (``sql``) and the migrations of
each component (``migrations``). Prints one line per failed check and exits 1, or prints ``ok``.
The checks go through the loaders sdcore itself uses (``importlib.resources``, Jinja2's
``PackageLoader``, Starlette's package ``StaticFiles``), never through the checkout.
"""

from __future__ import annotations

import json
import secrets
import sys
from importlib import resources
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    expected: dict[str, Any] = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    problems: list[str] = []

    import sdcore

    if not Path(sdcore.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()):
        problems.append(f"sdcore imported from {sdcore.__file__}, not from {sys.prefix}")
    package = resources.files("sdcore")
    problems.extend(
        f"missing from the installed package: sdcore/{name}"
        for name in expected["files"]
        if not package.joinpath(name).is_file()
    )
    problems.extend(_sql(expected))
    problems.extend(_dashboard())
    sys.stdout.write("".join(f"{problem}\n" for problem in problems) or "ok\n")
    return 1 if problems else 0


def _sql(expected: dict[str, Any]) -> list[str]:
    from sdcore._internal.sql import queries
    from sdcore.postgres import DEFAULT_TABLES, full_sql, migrations

    problems = []
    for file in expected["sql"]:
        try:
            if not queries(file):
                problems.append(f"sql/{file}.sql has no statement")
        except (KeyError, OSError) as exc:
            problems.append(f"sql/{file}.sql: {exc!r}")
    for component, names in expected["migrations"].items():
        try:
            found = [migration.name for migration in migrations(component)]
        except Exception as exc:
            problems.append(f"{component} migrations: {exc!r}")
            continue
        if found != names:
            problems.append(f"{component} migrations: {found} instead of {names}")
        try:
            ddl = full_sql(component, table=DEFAULT_TABLES[component])
        except Exception as exc:
            problems.append(f"full_sql({component!r}): {exc!r}")
        else:
            if "CREATE TABLE" not in ddl:
                problems.append(f"full_sql({component!r}) has no CREATE TABLE")
    return problems


def _dashboard() -> list[str]:
    from fastapi.testclient import TestClient

    from sdcore import Runtime
    from sdcore.dashboard import dashboard_app

    # Nothing connects: the login page and the static files need no database.
    runtime = Runtime(database_url="postgresql://nobody@127.0.0.1:1/none")
    try:
        app = dashboard_app(runtime, token=secrets.token_urlsafe(32))
    except Exception as exc:
        return [f"dashboard_app(): {exc!r}"]
    client = TestClient(app)
    problems = []
    page = client.get("/login")
    if page.status_code != 200 or "<form" not in page.text:
        problems.append(f"GET /login: {page.status_code} {page.text[:200]!r}")
    for name in ("dashboard.css", "dashboard.js"):
        static = client.get(f"/static/{name}")
        if static.status_code != 200 or not static.content:
            problems.append(f"GET /static/{name}: {static.status_code}")
    return problems


if __name__ == "__main__":
    sys.exit(main(sys.argv))
