"""Password redaction in DSNs and in messages that quote them, and a property over secrets."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdcore.postgres import redact_dsn, redact_text


@pytest.mark.parametrize(
    ("text", "secret_parts"),
    [
        ("connect postgresql://u:p@ss@h/db failed", ["p@ss", "@ss", "p@"]),
        ("password=a\\ b host=h", ["a\\ b", " b"]),
        ("password='x y\\' z' host=h", ["x y", "z'"]),
        ("host=h password=hunter2 port=5", ["hunter2"]),
        ("PASSWORD = hunter2", ["hunter2"]),
        ("both: postgres://a:sekrit1@h1/x and postgresql://b:sekrit2@h2/y", ["sekrit"]),
        ("postgresql://u:p%40ss@h:5432/db?sslmode=require", ["p%40ss"]),
        ("trailing backslash password=abc\\", ["abc"]),
    ],
    ids=[
        "url-raw-at",
        "kv-escaped-space",
        "kv-quoted",
        "kv",
        "kv-upper",
        "two-urls",
        "url-encoded",
        "kv-trailing-backslash",
    ],
)
def test_redact_text_masks_the_whole_secret(text: str, secret_parts: list[str]) -> None:
    out = redact_text(text)
    assert "***" in out
    for part in secret_parts:
        assert part not in out, out


def test_redact_text_keeps_what_is_not_secret() -> None:
    out = redact_text("connect postgresql://u:p@ss@db.internal:5432/app failed: timeout")
    assert out == "connect postgresql://u:***@db.internal:5432/app failed: timeout"
    assert redact_text("no secret here: host=h port=5") == "no secret here: host=h port=5"


def test_redact_text_with_the_dsn_masks_its_password_anywhere() -> None:
    dsn = "host=h password=s3cr3t"
    assert redact_text("server said: bad s3cr3t!", dsn) == "server said: bad ***!"
    assert redact_text("x", "not a dsn ' unbalanced") == "x"


def test_redact_dsn() -> None:
    assert redact_dsn("postgresql://u:pw@h:5/db") == "user=u password=*** dbname=db host=h port=5"
    assert "pw" not in redact_dsn("postgresql://u:pw@h/db?password=other")
    assert redact_dsn("host=h") == "host=h"
    # Unparsable: still masked, never raised.
    assert "hunter2" not in redact_dsn("postgresql://u:hunter2@h/db?=' broken")


_secret = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp")),
    min_size=4,
    max_size=24,
)


@given(_secret)
def test_a_url_password_never_survives(secret: str) -> None:
    dsn = f"postgresql://app:{quote(secret, safe='')}@db.internal:5432/app"
    out = redact_text(f"error connecting to {dsn}: refused")
    # Exactly the text with the password masked: nothing of it survives (a plain "not in"
    # failed for the secret "post", which "postgresql" contains anyway).
    assert out == "error connecting to postgresql://app:***@db.internal:5432/app: refused"
    assert redact_dsn(dsn).count("***") == 1


@given(_secret)
def test_a_keyword_password_never_survives(secret: str) -> None:
    quoted = "'" + secret.replace("\\", "\\\\").replace("'", "\\'") + "'"
    dsn = f"host=db password={quoted} dbname=app"
    assert secret not in redact_text(f"failed: {dsn}", dsn).replace("host=db dbname=app", "")
    assert sorted(redact_dsn(dsn).split()) == ["dbname=app", "host=db", "password=***"]
