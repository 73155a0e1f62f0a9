"""What an index page would show of sdcore: classifiers and keywords that say what it is."""

from __future__ import annotations

import tomllib

from tests.docs.test_samples import ROOT


def test_the_metadata_names_the_supported_pythons_status_and_audience() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    classifiers = set(project["classifiers"])
    for minor in ("3.11", "3.12", "3.13"):  # the wheel's demo passes on each
        assert f"Programming Language :: Python :: {minor}" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert "Intended Audience :: Developers" in classifiers
    assert "Framework :: FastAPI" in classifiers
    assert {"postgresql", "scheduler", "outbox"} <= set(project["keywords"])
