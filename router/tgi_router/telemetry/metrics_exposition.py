"""The Prometheus text exposition (format 0.0.4) as TGI's exporter writes it.

TGI serves its metrics with `metrics-exporter-prometheus`: counters carry no
`_total` suffix and no `_created` series (`tgi_request_count 5`), which
`prometheus_client.generate_latest` cannot produce, since it always renames
counters to `<name>_total`."""

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def exposition(registry: CollectorRegistry, aliases: dict[str, str]) -> bytes:
    """Every family of `registry` in the text format; a family named in
    `aliases` is written a second time under its alias."""
    lines: list[str] = []
    for family in registry.collect():
        _write_family(lines, family, family.name)
        if family.name in aliases:
            _write_family(lines, family, aliases[family.name])
    return "".join(lines).encode("utf-8")


def _write_family(lines: list[str], family: Metric, name: str) -> None:
    help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    lines.append(f"# HELP {name} {help_text}\n")
    lines.append(f"# TYPE {name} {family.type}\n")
    for sample in family.samples:
        suffix = sample.name[len(family.name):]
        if suffix == "_created":
            continue
        if family.type == "counter":
            suffix = ""  # prometheus_client's `_total`; TGI has none
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
        labels = f"{{{labels}}}" if labels else ""
        lines.append(f"{name}{suffix}{labels} {floatToGoString(sample.value)}\n")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
