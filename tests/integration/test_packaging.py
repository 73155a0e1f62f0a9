"""The sdist and the wheel carry what sdcore reads at run time, and work once installed.

The distributions are built from the checkout offline (``python -m build --no-isolation``, with
hatchling from the dev extra), the wheel from the sdist as a package index's user would get it.
The wheel is installed with ``--no-deps --no-index`` into a fresh venv that sees this
environment's packages (psycopg, FastAPI, Jinja2…) behind its own, so no index is needed and the
checkout's ``src`` is never on its path: a file missing from the wheel is missing there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import sdcore
from tests.docs.test_samples import ROOT

pytestmark = pytest.mark.slow

PACKAGE = ROOT / "src" / "sdcore"
PROBE = Path(__file__).with_name("_wheel_probe.py")
TIMEOUT_S = 120
# The sdist's top level: pyproject's include list, plus what hatchling always adds.
SDIST_TOP = {
    *("src", "tests", "docs", "examples", "benchmarks", ".ci", "CHANGELOG.md", "conftest.py"),
    *("pyproject.toml", "README.md", "LICENSE", ".gitignore", "PKG-INFO"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Dists:
    """The built distributions."""

    sdist: Path
    wheel: Path


def _run(command: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command without the checkout's ``PYTHONPATH``; fail with its output."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{command}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done


def _package_files() -> list[str]:
    """Every file of the checkout's package, relative to it (bytecode caches aside)."""
    return sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def _data_files() -> list[str]:
    return [name for name in _package_files() if not name.endswith(".py")]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)])
    version = sdcore.__version__
    sdist = out / f"sdcore-{version}.tar.gz"
    wheel = out / f"sdcore-{version}-py3-none-any.whl"
    assert sdist.is_file(), sorted(p.name for p in out.iterdir())
    assert wheel.is_file(), sorted(p.name for p in out.iterdir())
    return Dists(sdist=sdist, wheel=wheel)


def test_the_checkout_has_the_data_the_package_reads() -> None:
    data = _data_files()
    assert "py.typed" in data
    assert any(name.startswith("postgres/sql/migrations/") for name in data)
    assert any(name.startswith("dashboard/templates/") for name in data)
    assert any(name.startswith("dashboard/static/") for name in data)
    assert "django/templates/admin/sdcore/action_form.html" in data


def test_the_wheel_carries_every_file_of_the_package(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
    missing = [name for name in _package_files() if f"sdcore/{name}" not in names]
    assert not missing, f"not in {dists.wheel.name}: {missing}"
    info = f"sdcore-{sdcore.__version__}.dist-info"
    assert {f"{info}/licenses/LICENSE", f"{info}/entry_points.txt"} <= names


def test_the_sdist_carries_the_package_and_the_project_files(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = [f"src/sdcore/{name}" for name in _package_files()]
    wanted += ["pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "PKG-INFO"]
    missing = [name for name in wanted if name not in names]
    assert not missing, f"not in {dists.sdist.name}: {missing}"
    top = {name.split("/", 1)[0] for name in names}
    assert top <= SDIST_TOP, f"unexpected in {dists.sdist.name}: {sorted(top - SDIST_TOP)}"


def test_twine_accepts_both_distributions(dists: Dists) -> None:
    done = _run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dists.sdist), str(dists.wheel)]
    )
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_installed_wheel_reads_its_sql_templates_and_static_files(
    dists: Dists, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    install = ["install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q"]
    _run([sys.executable, "-m", "pip", "--python", str(python), *install, str(dists.wheel)])
    # This environment's packages, after the venv's own: a plain path line, so the .pth files
    # there (an editable install's path to the checkout) are not read.
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
        ).stdout.strip()
    )
    (site / "zz_dependencies.pth").write_text(
        sysconfig.get_path("purelib") + "\n", encoding="utf-8"
    )

    migrations = PACKAGE / "postgres" / "sql" / "migrations"
    expected = {
        "files": _data_files(),
        "sql": sorted(path.stem for path in (PACKAGE / "postgres" / "sql").glob("*.sql")),
        "migrations": {
            folder.name: sorted(path.stem for path in folder.glob("*.sql"))
            for folder in sorted(migrations.iterdir())
            if folder.is_dir()
        },
    }
    wanted = tmp_path / "expected.json"
    wanted.write_text(json.dumps(expected), encoding="utf-8")
    probe = _run([str(python), str(PROBE), str(wanted)], cwd=tmp_path)
    assert probe.stdout.strip() == "ok", probe.stdout

    command = venv / "bin" / "sdcore"
    assert "schedules" in _run([str(command), "--help"], cwd=tmp_path).stdout
    version = _run([str(command), "--version"], cwd=tmp_path).stdout
    assert sdcore.__version__ in version
    ddl = _run([str(command), "db", "sql", "--outbox", "--schedules"], cwd=tmp_path).stdout
    assert "CREATE TABLE" in ddl
