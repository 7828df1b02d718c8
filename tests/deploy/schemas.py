"""Validators for the JSON schemas shipped under deploy/schemas (see
deploy/schemas/derive.py for where they come from); nothing is fetched."""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
from referencing import Registry, Resource

from .doc_snippets import ROOT

SCHEMAS = ROOT / "deploy" / "schemas"
KUBERNETES = next((SCHEMAS / "kubernetes").iterdir())


def _load(path) -> dict:
    return json.loads(path.read_text())


@cache
def compose_validator() -> jsonschema.protocols.Validator:
    schema = _load(SCHEMAS / "compose-spec.json")
    return jsonschema.validators.validator_for(schema)(schema)


def kubernetes_validator(manifest: dict) -> jsonschema.protocols.Validator:
    """The strict schema of `manifest`'s kind and apiVersion, resolved the way
    kubernetes-validate resolves it (Draft 2020-12, `_definitions.json`)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", manifest["apiVersion"])
    schema = _load(KUBERNETES / f"{manifest['kind'].lower()}-{group_version}.json")
    registry = Resource.from_contents(_load(KUBERNETES / "_definitions.json")) @ (
        Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def errors(validator: jsonschema.protocols.Validator, document: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
