"""Checks a Prometheus text exposition the way Prometheus itself would: with
`promtool check metrics` when the binary exists (Debian's `prometheus`
package), and always with prometheus_client's text parser."""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

# promtool's lint rules that TGI's own metric names break (`tgi_request_count`
# is a counter without `_total`); the names are TGI's and must stay.
TGI_NAMING_LINTS = ('counter metrics should have "_total" suffix',
                    'non-histogram and non-summary metrics should not have "_count" suffix')
PROMTOOL = shutil.which("promtool")


def parse_families(text: str) -> dict[str, str]:
    """name -> type of every family; raises ValueError on malformed input."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def promtool_problems(text: str) -> list[str]:
    """promtool's complaints other than TGI's naming; an AssertionError when
    it cannot parse the text (exit 1)."""
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode in (0, 3), f"promtool exit {result.returncode}: {result.stderr}{result.stdout}"
    lines = (result.stdout + result.stderr).splitlines()
    return [line for line in lines if line.strip() and not line.endswith(TGI_NAMING_LINTS)]


def check_exposition(text: str) -> None:
    """Both checks; the promtool one only where promtool is installed."""
    assert parse_families(text)
    if PROMTOOL:
        assert promtool_problems(text) == []
