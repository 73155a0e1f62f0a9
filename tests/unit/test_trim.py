"""``code`` trimming follows JavaScript's ``String.prototype.trim``: the table in
docs/reference/keys.md, checked against the library and (when installed) Node itself."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sdcore.job_scheduler import JobAcquireOptions, lock_key
from sdcore.job_scheduler._options import JS_TRIM_CHARS, js_trim

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "keys.md"
ROW = re.compile(r"^\| `(?P<code>[^`]*)` \| `(?P<trimmed>[^`]*)` \| `(?P<key>v2:[0-9a-f]{64})` \|$")
RUN_KEY = "2026-07-20T03:00:00Z"


def _table() -> list[tuple[str, str, str]]:
    section = DOC.read_text(encoding="utf-8").split("## Trimming the code", 1)[1]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            rows.append(
                (
                    json.loads(f'"{match["code"]}"'),
                    json.loads(f'"{match["trimmed"]}"'),
                    match["key"],
                )
            )
    return rows


TABLE = _table()


def test_the_docs_table_is_there() -> None:
    assert len(TABLE) >= 7


@pytest.mark.parametrize(("code", "trimmed", "key"), TABLE, ids=[repr(r[0]) for r in TABLE])
def test_trim_table(code: str, trimmed: str, key: str) -> None:
    assert js_trim(code) == trimmed
    assert JobAcquireOptions(code=code, run_key=RUN_KEY).code == trimmed
    assert lock_key(code, RUN_KEY) == key


def test_the_trim_set_is_exactly_javascripts() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = (
        "const out=[];for(let c=0;c<0x10000;c++){if(c>=0xd800&&c<=0xdfff)continue;"
        "if(('a'+String.fromCharCode(c)).trim()==='a')out.push(c)}"
        "console.log(JSON.stringify(out))"
    )
    result = subprocess.run([node, "-e", script], capture_output=True, check=True, timeout=30)
    assert json.loads(result.stdout) == sorted(ord(c) for c in JS_TRIM_CHARS)
    codes = [row[0] for row in TABLE]
    echo = "console.log(JSON.stringify(JSON.parse(process.argv[1]).map(s => s.trim())))"
    result = subprocess.run(
        [node, "-e", echo, json.dumps(codes)], capture_output=True, check=True, timeout=30
    )
    assert json.loads(result.stdout) == [row[1] for row in TABLE]
