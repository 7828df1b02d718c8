"""docs/reference/metrics.md matches what /metrics serves (names, types,
labels), and that exposition is valid for Prometheus: its own `promtool`
where installed, prometheus_client's text parser always."""

import re

import pytest

from tgi_router.telemetry.metrics import Metrics

from .doc_snippets import ROOT
from .prometheus_check import PROMTOOL, parse_families, promtool_problems

ROW = re.compile(r"^\| `(tgi_\w+)` \| (\w+) \| *(`\w+`)? *\|", re.M)
EXPOSITION = Metrics(max_input_tokens=1024, max_total_tokens=2048, adapters=("an-adapter",)).render().decode()


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    return {name: (kind, frozenset([label.strip("`")] if label else []))
            for name, kind, label in ROW.findall(text)}


def served() -> dict[str, tuple[str, frozenset[str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: (f.type, frozenset(k for s in f.samples for k in s.labels if k != "le"))
            for f in text_string_to_metric_families(EXPOSITION)}


def test_every_served_metric_is_documented_with_its_type_and_labels():
    assert documented() == served()


def test_prometheus_client_parser_reads_the_exposition():
    families = parse_families(EXPOSITION)
    assert families["tgi_request_count"] == "counter"
    assert families["tgi_request_duration"] == "histogram"
    assert families["tgi_queue_size"] == "gauge"


@pytest.mark.skipif(not PROMTOOL, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_exposition_except_tgi_naming():
    assert promtool_problems(EXPOSITION) == []


@pytest.mark.skipif(not PROMTOOL, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_rejects_a_malformed_exposition():
    with pytest.raises(AssertionError, match="promtool exit 1"):
        promtool_problems("tgi_request_count{err 1\n")
