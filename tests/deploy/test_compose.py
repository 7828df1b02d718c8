"""docker-compose.yml, checked without Docker: the Compose Specification's
schema accepts it, its servers' commands are launcher flags, and Prometheus
scrapes them."""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tgi_router.launch.config import RouterConfig, build_parser

from .doc_snippets import ROOT
from .schemas import compose_validator, errors

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` / `$$`, enough for this file."""
    def value(match: re.Match) -> str:
        name, default = match.group(1), match.group(3) or ""
        return env.get(name) or default
    return re.sub(r"\$\{(\w+)(:?-([^}]*))?\}", value, text).replace("$$", "$")


def test_compose_file_validates_against_the_compose_specification():
    assert errors(compose_validator(), COMPOSE) == []


def test_the_schema_rejects_a_misspelled_key():
    broken = {"services": {"tgi": {"image": "x", "helthcheck": {}}}}
    assert any("helthcheck" in e for e in errors(compose_validator(), broken))


def test_gpu_service_takes_the_usual_tgi_flags():
    command = [interpolate(a, {}) for a in SERVICES["tgi"]["command"]]
    for flag in ("--model-id", "--num-shard", "--quantize", "--max-input-tokens", "--max-total-tokens",
                 "--max-batch-size"):
        assert flag in command
    build_parser().parse_args(command)  # every flag known, every value well-formed


def test_gpu_service_reserves_nvidia_gpus_and_shared_memory():
    devices = SERVICES["tgi"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert SERVICES["tgi"]["shm_size"] == "1g"


@pytest.mark.parametrize("service", ["tgi", "tgi-cpu"])
def test_servers_take_hf_token_from_the_environment_and_cache_in_data(service):
    spec = SERVICES[service]
    assert spec["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}"
    assert [interpolate(v, {}) for v in spec["volumes"]] == ["./data:/data"]
    assert interpolate(spec["volumes"][0], {"DATA_DIR": "/models"}) == "/models:/data"
    assert spec["ports"] and all(p.endswith(":80") for p in spec["ports"])


@pytest.mark.parametrize("service", ["tgi", "tgi-cpu"])
def test_servers_get_longer_to_drain_than_the_launchers_graceful_termination(service):
    grace = SERVICES[service]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > RouterConfig().graceful_termination_timeout


@pytest.mark.parametrize("service", ["tgi", "tgi-cpu"])
def test_servers_have_a_healthcheck_on_health(service):
    test = SERVICES[service]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "/health" in test[1] and "curl -f" in test[1]


def test_cpu_server_is_a_profile_built_for_cpu():
    spec = SERVICES["tgi-cpu"]
    assert spec["profiles"] == ["cpu"] and spec["build"]["args"]["DEVICE"] == "cpu"
    assert "profiles" not in SERVICES["tgi"]
    build_parser().parse_args([interpolate(a, {}) for a in spec["command"]])


def test_environment_overrides_reach_the_command():
    command = [interpolate(a, {"NUM_SHARD": "4", "QUANTIZE": "gptq"}) for a in SERVICES["tgi"]["command"]]
    args = build_parser().parse_args(command)
    assert (args.num_shard, args.quantize) == (4, "gptq")


def test_prometheus_scrapes_every_server_on_metrics():
    mount = next(v for v in SERVICES["prometheus"]["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro"))
    assert (ROOT / mount.split(":")[0]).resolve() == PROMETHEUS_CONFIG
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    assert job["metrics_path"] == "/metrics" and targets == {"tgi:80", "tgi-cpu:80"}


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_prometheus_config():
    result = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "NO_COLOR": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
