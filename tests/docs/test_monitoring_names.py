"""The metric names of the monitoring guide's alerts and of the shipped Grafana dashboard exist,
and every metric sdcore exposes is documented there."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdcore.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "how-to" / "monitoring.md"
DASHBOARD = ROOT / "docs" / "monitoring" / "grafana-sdcore.json"
_NAME = re.compile(r"\bsdcore_[a-z_]+")


def _family(name: str) -> str:
    """``…_bucket`` / ``_count`` / ``_sum`` are series of a histogram family."""
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name.removesuffix(suffix) in METRIC_NAMES:
            return name.removesuffix(suffix)
    return name


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def _alert_exprs(markdown: str) -> list[str]:
    return re.findall(r"^\s*expr: (.+)$", markdown, flags=re.MULTILINE)


def test_every_alert_expression_uses_existing_metrics() -> None:
    exprs = _alert_exprs(GUIDE.read_text(encoding="utf-8"))
    assert len(exprs) >= 15
    used = {_family(name) for expr in exprs for name in _NAME.findall(expr)}
    assert used, "no metric in the alert examples"
    assert used <= METRIC_NAMES, sorted(used - METRIC_NAMES)


def test_the_dashboard_is_valid_json_using_existing_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = list(_exprs(dashboard))
    used = {_family(name) for expr in exprs for name in _NAME.findall(expr)}
    assert used <= METRIC_NAMES, sorted(used - METRIC_NAMES)
    # Every family is on a panel, and every panel has a query.
    assert used == METRIC_NAMES, sorted(METRIC_NAMES - used)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_metric_is_documented_with_its_meaning() -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(sdcore_[a-z_]+)` \|", guide, flags=re.MULTILINE))
    assert documented == METRIC_NAMES, sorted(METRIC_NAMES ^ documented)
    alerted = {_family(n) for expr in _alert_exprs(guide) for n in _NAME.findall(expr)}
    assert alerted == METRIC_NAMES, sorted(METRIC_NAMES - alerted)
