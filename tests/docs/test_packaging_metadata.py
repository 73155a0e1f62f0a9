"""What an index page would show of sdcore: classifiers and keywords that say what it is."""

from __future__ import annotations

import tomllib

import trove_classifiers  # hatchling's dependency, in the dev extra

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


def test_the_metadata_links_every_page_an_index_shows_and_names_the_license() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    urls = project["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues", "Source"}
    assert all(url.startswith(urls["Source"]) for url in urls.values())
    assert urls["Changelog"].endswith("/CHANGELOG.md")
    # PEP 639: an SPDX expression and the license file, never a "License ::" classifier as well.
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").is_file()
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_every_classifier_is_a_known_one() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    unknown = [c for c in project["classifiers"] if c not in trove_classifiers.classifiers]
    assert not unknown
    assert {"Framework :: AsyncIO", "Typing :: Typed"} <= set(project["classifiers"])
    assert any(c.startswith("Topic :: ") for c in project["classifiers"])
