"""Refreshes the JSON schemas that tests/deploy validate against, offline.

    pip install check-jsonschema kubernetes-validate   # in any scratch venv
    python deploy/schemas/derive.py

* compose-spec.json: the Compose Specification's schema as vendored, unchanged,
  by check-jsonschema (its `vendor.compose-spec`), with its licence.
* kubernetes/<version>/: kubernetes-validate's strict schemas (generated from
  Kubernetes' OpenAPI document) for the kinds under deploy/kubernetes/, and
  their `_definitions.json` trimmed to the definitions those kinds reach
  through `$ref`; every kept definition is byte-for-byte the original.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path

HERE = Path(__file__).parent
KINDS = ("deployment-apps-v1", "service-v1", "configmap-v1")
REF = re.compile(r'"\$ref":\s*"(?:/api/_definitions\.json)?#/\$defs/([^"]+)"')


def latest_strict(root: Path) -> Path:
    versions = [p for p in root.iterdir() if p.name.endswith("-local-strict")]
    return max(versions, key=lambda p: tuple(int(x) for x in p.name[1:].split("-")[0].split(".")))


def reachable(definitions: dict, roots: list[str]) -> set[str]:
    seen, todo = set(), [name for text in roots for name in REF.findall(text)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(REF.findall(json.dumps(definitions[name])))
    return seen


def derive_kubernetes() -> Path:
    source = latest_strict(Path(str(resources.files("kubernetes_validate") / "kubernetes-json-schema")))
    target = HERE / "kubernetes" / source.name
    target.mkdir(parents=True, exist_ok=True)
    texts = []
    for kind in KINDS:
        shutil.copyfile(source / f"{kind}.json", target / f"{kind}.json")
        texts.append((source / f"{kind}.json").read_text())
    full = json.loads((source / "_definitions.json").read_text())
    keep = reachable(full["$defs"], texts)
    trimmed = {**full, "$defs": {k: v for k, v in full["$defs"].items() if k in keep}}
    (target / "_definitions.json").write_text(json.dumps(trimmed, indent=1, sort_keys=True) + "\n")
    return target


def derive_compose() -> None:
    vendor = Path(str(resources.files("check_jsonschema") / "builtin_schemas" / "vendor"))
    shutil.copyfile(vendor / "compose-spec.json", HERE / "compose-spec.json")
    shutil.copyfile(vendor / "licenses" / "LICENSE.compose-spec", HERE / "LICENSE.compose-spec")


if __name__ == "__main__":
    derive_compose()
    print("kubernetes schemas in", derive_kubernetes())
