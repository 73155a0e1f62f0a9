"""Every public name is documented in docs/reference.

A name counts as documented when it appears as a word in inline code (`` `Name` ``,
`` `Name(...)` ``, `` `module.Name` ``) or in a heading of a reference page that names its module
(`` sdcore.postgres ``, for instance); code blocks do not count. The public modules are found by
walking the package, as ``tests/unit/test_public_api.py`` pins them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_public_api import declared_all, public_modules

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"
_FENCED = re.compile(r"^[ ]*```.*?^[ ]*```[ ]*$", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # a code span may wrap, not span paragraphs
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def documented_words(text: str) -> set[str]:
    """The words of a page's inline code and headings, code blocks left out."""
    prose = _FENCED.sub("", text)
    pieces = _CODE.findall(prose)
    pieces += [line for line in prose.splitlines() if line.startswith("#")]
    return {word for piece in pieces for word in _WORD.findall(piece)}


def _pages() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in REFERENCE.glob("*.md")}


@pytest.mark.parametrize("module", public_modules())
def test_every_public_name_is_in_the_reference(module: str) -> None:
    pages = _pages()
    # A page names the module as `sdcore.x` (or `sdcore.x.Name`); the package's own names
    # (`sdcore.Runtime`) may sit on any page.
    mention = re.compile(rf"{re.escape(module)}(?![A-Za-z0-9_])")
    words: set[str] = set()
    for text in pages.values():
        if module == "sdcore" or mention.search(text):
            words |= documented_words(text)
    missing = [name for name in declared_all(module) if name not in words]
    assert missing == [], f"{module}: not in docs/reference/*.md: {missing}"


def test_the_check_sees_only_inline_code_and_headings() -> None:
    text = (
        "# `Alpha` and Beta\n\nSee `gamma(x,\ny)` and delta.\n\n```python\nEpsilon()\n```\n"
        "A lone ` tick.\n\nZeta ` here.\n"
    )
    assert {"Alpha", "Beta", "gamma", "x", "y"} <= documented_words(text)
    assert {"delta", "Epsilon", "tick", "Zeta"}.isdisjoint(documented_words(text))
