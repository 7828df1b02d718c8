"""deploy/grafana: the dashboard's every query names only metrics a running
server exports (its live /metrics, a tiny model behind the launcher), every
panel reads the provisioned Prometheus data source, and docker-compose.yml
mounts the provisioning and dashboards where Grafana reads them."""

import json
import re

import httpx
import pytest
import yaml

from ..e2e.router_harness import launch
from ..shard_harness import save_tiny_model, save_tiny_tokenizer
from .doc_snippets import ROOT

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "tgi.json").read_text())
DATASOURCES = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
# A histogram's series: the family's name with one of these suffixes.
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def queries() -> list[str]:
    return [t["expr"] for panel in DASHBOARD["panels"] for t in panel["targets"]]


def queried_series() -> set[str]:
    return {name for expr in queries() for name in re.findall(r"\b(tgi_\w+)", expr)}


def family(series: str, types: dict[str, str]) -> str | None:
    """The metric family a queried series belongs to: itself, or a histogram's
    `_bucket`/`_sum`/`_count` series; None when the server exports neither."""
    if series in types:
        return series
    for suffix in _SERIES_SUFFIXES:
        base = series.removesuffix(suffix)
        if series.endswith(suffix) and types.get(base) == "histogram":
            return base
    return None


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory) -> dict[str, str]:
    """Metric family -> type, as a running launcher's /metrics declares them
    (an adapter-free tiny model: the LoRA family is declared, with no series)."""
    tmp = tmp_path_factory.mktemp("grafana")
    path = save_tiny_model("llama", tmp / "model", vocab_size=320, bos_token_id=256, eos_token_id=None)
    save_tiny_tokenizer(path)
    proc, url = launch(str(path), tmp)
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(30)
    return dict(re.findall(r"^# TYPE (\w+) (\w+)$", text, re.M))


def test_every_query_names_only_metrics_the_server_exports(live_metrics):
    queried = queried_series()
    assert queried, "the dashboard queries nothing"
    assert not [s for s in queried if family(s, live_metrics) is None]


def test_the_dashboard_covers_what_an_operator_watches(live_metrics):
    wanted = {"tgi_request_count", "tgi_request_failure", "tgi_request_duration",
              "tgi_request_time_to_first_token_duration", "tgi_request_inter_token_latency_duration",
              "tgi_batch_current_size", "tgi_queue_size", "tgi_kv_cache_blocks_used", "tgi_kv_cache_blocks_cached",
              "tgi_prefix_cache_hit_tokens", "tgi_prefix_cache_queried_tokens"}
    assert wanted <= {family(s, live_metrics) for s in queried_series()}


def test_every_panel_reads_the_provisioned_prometheus():
    (source,) = DATASOURCES["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])
    assert len({p["title"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])


def test_compose_provisions_grafana_from_the_repository():
    grafana = COMPOSE["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":") for v in grafana["volumes"])
    assert (ROOT / mounts["./deploy/grafana/provisioning"]).name == "provisioning"
    assert (ROOT / "deploy/grafana/provisioning").is_dir() and (ROOT / "deploy/grafana/dashboards").is_dir()
    assert {target for target in mounts.values()} == {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "prometheus" in grafana["depends_on"] and grafana["ports"] == ["3000:3000"]
