"""The named-statement files: every file loads, every ``{{name}}`` include resolves."""

from __future__ import annotations

from importlib import resources

import pytest
from psycopg import sql

from sdcore._internal.sql import _expand, _pieces, queries
from sdcore.job_scheduler._sql import LeaseStatements, TickBatchStatements, TickStatements


def _files() -> list[str]:
    folder = resources.files("sdcore.postgres").joinpath("sql")
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".sql"))


@pytest.mark.parametrize("file", _files())
def test_every_file_loads_with_its_includes_expanded(file: str) -> None:
    statements = queries(file)
    assert statements
    if file != "fragments":
        assert not any("{{" in body for body in statements.values())


def test_the_lease_statements_state_each_takeover_rule_once() -> None:
    # The four acquire statements share their takeover rules through fragments.sql.
    table = sql.Identifier("job_scheduler")
    lease = LeaseStatements.render(table)
    ticks = TickStatements.render(table)
    batch = TickBatchStatements.render(table)
    for statement in (lease.acquire, lease.acquire_many, ticks.acquire_attempt):
        assert b"greatest(nextval('\"job_scheduler_fencing_seq\"'::regclass)" in statement
    for statement in (ticks.acquire_attempt, batch.acquire_attempt_many):
        assert b"j.given_back IS NOT NULL" in statement
        assert b"j.data ?" not in statement  # the caller's data is never read as lease state
        assert b"2147483647::float8" in statement
    for name, body in _pieces().items():
        assert "--" not in body, f"piece {name!r} kept a comment line"


def test_an_unknown_or_circular_include_is_a_packaging_error() -> None:
    with pytest.raises(KeyError, match=r"includes \{\{nope\}\}, not in sql/fragments.sql"):
        _expand("SELECT {{nope}}", {}, "lease", ())
    with pytest.raises(KeyError, match="includes itself"):
        _expand("SELECT {{a}}", {"a": "({{b}})", "b": "{{a}}"}, "lease", ())
    assert _expand("SELECT {{a}}", {"a": "({{b}})", "b": "1"}, "lease", ()) == "SELECT (1)"
