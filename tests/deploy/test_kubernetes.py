"""deploy/kubernetes: the manifests validate against Kubernetes' strict
schemas (shipped in deploy/schemas), and replicas of the server sit behind a
Service with health probes and Prometheus scrape annotations."""

import copy
import shutil
import subprocess

import pytest
import yaml

from tgi_router.launch.config import build_parser

from .doc_snippets import ROOT
from .schemas import errors, kubernetes_validator

MANIFESTS = {p.name: doc for p in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
             for doc in yaml.safe_load_all(p.read_text()) if doc}
DEPLOYMENT = MANIFESTS["deployment.yaml"]
SERVICE = MANIFESTS["service.yaml"]
POD = DEPLOYMENT["spec"]["template"]
CONTAINER = POD["spec"]["containers"][0]


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_manifest_validates_against_the_kubernetes_schema(name):
    assert errors(kubernetes_validator(MANIFESTS[name]), MANIFESTS[name]) == []


def test_the_strict_schema_rejects_an_unknown_field():
    broken = copy.deepcopy(DEPLOYMENT)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    assert any("readinessprobe" in e for e in errors(kubernetes_validator(broken), broken))


def test_replicas_sit_behind_a_service():
    assert DEPLOYMENT["spec"]["replicas"] >= 2
    labels = POD["metadata"]["labels"]
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert SERVICE["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in CONTAINER["ports"]}
    assert {p["targetPort"] for p in SERVICE["spec"]["ports"]} <= port_names


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_get_health_on_the_served_port(probe):
    get = CONTAINER[probe]["httpGet"]
    (port,) = [p for p in CONTAINER["ports"] if p["name"] == get["port"]]
    env = {e["name"]: e.get("value") for e in CONTAINER["env"]}
    assert get["path"] == "/health" and str(port["containerPort"]) == env["PORT"]


def test_container_args_are_launcher_flags():
    build_parser().parse_args(CONTAINER["args"])


def test_sharding_inside_the_pod_uses_every_gpu_of_the_pod():
    args = build_parser().parse_args(CONTAINER["args"])
    assert args.num_shard == CONTAINER["resources"]["limits"]["nvidia.com/gpu"] > 1
    shm = next(v for v in POD["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_hf_token_comes_from_an_optional_secret():
    (token,) = [e for e in CONTAINER["env"] if e["name"] == "HF_TOKEN"]
    assert "value" not in token and token["valueFrom"]["secretKeyRef"]["optional"] is True


def test_termination_grace_outlasts_the_drain():
    args = build_parser().parse_args(CONTAINER["args"])
    assert POD["spec"]["terminationGracePeriodSeconds"] > args.graceful_termination_timeout


def test_pods_carry_prometheus_scrape_annotations():
    annotations = POD["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) in {p["containerPort"] for p in CONTAINER["ports"]}


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_pod_scrape_config(tmp_path):
    config = tmp_path / "prometheus.yml"
    config.write_text(MANIFESTS["prometheus-scrape-config.yaml"]["data"]["prometheus.yml"])
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    if "kubernetes_sd_configs not found" in result.stdout + result.stderr:
        pytest.skip("this promtool build has no Kubernetes service discovery (Debian's)")
    assert result.returncode == 0, result.stdout + result.stderr
