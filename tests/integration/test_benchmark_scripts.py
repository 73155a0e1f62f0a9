"""The benchmark scripts still start and still render their SQL (CI never runs them in full).

A script builds its statements (its pgbench scripts too) before it measures anything, and
nothing else runs it: a statement that gains a parameter would otherwise break it silently.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from sdcore.outbox import Outbox

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_script_starts(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_the_outbox_pgbench_scripts_bind_every_parameter() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "sdcore_bench_outbox", BENCHMARKS / "outbox.py"
        )
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        scripts = module.pgbench_scripts(Outbox())
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("sdcore_bench_outbox", None)
    assert set(scripts) == {"plain", "+enqueue_sql", "+debounced_sql", "+sql_no_notify"}
    for name, text in scripts.items():
        assert "%(" not in text, name
        assert "%s" not in text, name
    assert "pg_notify" in scripts["+enqueue_sql"]
    assert "pg_notify" not in scripts["+sql_no_notify"]
