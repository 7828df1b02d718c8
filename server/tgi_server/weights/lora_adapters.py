"""LoRA adapters as PEFT saves them, named by --lora-adapters in TGI's
syntax: comma-separated entries, each a hub id or local directory (named by
itself) or `name=path`.

An adapter directory holds adapter_config.json and adapter_model.safetensors
with, for each targeted linear M, `base_model.model.<M>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. The layer computes
y = W x + scale * B (A x), scale = alpha / r (alpha / sqrt(r) with
use_rslora), alpha from alpha_pattern where a key names the module.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .errors import CheckpointError
from .resolve import hub_snapshot

_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(.+)\.lora_([AB])\.weight")
_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@dataclass(frozen=True)
class LoraModule:
    """One targeted linear: A [r, in], B [out, r] (float32, CPU), scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class Adapter:
    """name: what requests name it by; modules: HF module name
    (model.layers.0.self_attn.q_proj) -> its LoraModule."""

    name: str
    modules: dict[str, LoraModule]


def parse_spec(text: str) -> list[tuple[str, str]]:
    """'a/b,name=/path' -> [("a/b", "a/b"), ("name", "/path")]; CheckpointError on a malformed list."""
    entries = []
    for item in (part.strip() for part in text.split(",")):
        name, _, path = item.partition("=") if "=" in item else (item, "", item)
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise CheckpointError(f"--lora-adapters: {item!r} is not an adapter id or name=path")
        entries.append((name, path))
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise CheckpointError(f"--lora-adapters: an adapter name appears twice ({', '.join(names)})")
    return entries


def load_adapters(text: str) -> list[Adapter]:
    """The adapters --lora-adapters `text` names, in order."""
    return [load_adapter(name, path) for name, path in parse_spec(text)]


def load_adapter(name: str, path: str) -> Adapter:
    local = Path(path).expanduser()
    directory = local if local.is_dir() else hub_snapshot(path, None, _FILES, "LoRA adapter")
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        tensors = load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"LoRA adapter {name!r} ({directory}): cannot read adapter_config.json and "
                              f"adapter_model.safetensors ({str(err).splitlines()[0]})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise CheckpointError(f"LoRA adapter {name!r}: only plain LoRA is served "
                              f"(peft_type {config.get('peft_type')!r}, use_dora {config.get('use_dora')})")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.fullmatch(key.removeprefix(_PREFIX))
        if match is None:
            raise CheckpointError(f"LoRA adapter {name!r}: unsupported tensor {key} (embedding LoRA, biases "
                                  "and modules_to_save are not served)")
        pairs.setdefault(match[1], {})[match[2]] = tensor.float()
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise CheckpointError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B, or their ranks differ")
        rank = ab["A"].shape[0]
        alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = LoraModule(ab["A"].contiguous(), ab["B"].contiguous(), float(scale))
    return Adapter(name, modules)


def _pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override: a key matching the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default
