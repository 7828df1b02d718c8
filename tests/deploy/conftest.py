"""The CPU image, built once a session with whichever engine is present
(docker with a running daemon, else podman: `make test` installs podman
where it runs as root on Debian), its layers cached by the engine between
runs on one machine; and a model folder to mount at /data."""

import subprocess
import time

import pytest

from deploy.image.build import DEFAULT_TAG, build_image
from tgi_server.weights.resolve import default_model_path

from .engine_at_hand import ENGINE


@pytest.fixture(scope="session")
def image() -> str:
    tag, start = DEFAULT_TAG["cpu"], time.monotonic()
    try:
        build_image(ENGINE, "cpu", tag)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the image build failed ({ENGINE.name}, exit {e.returncode}):\n{(e.stdout + e.stderr)[-3000:]}")
    print(f"\n{tag} built with {ENGINE.describe()} in {time.monotonic() - start:.0f} s")
    return tag


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A folder holding only SmolLM2's GGUF file, readable by any user."""
    folder, gguf = tmp_path_factory.mktemp("data"), default_model_path()
    (folder / gguf.name).write_bytes(gguf.read_bytes())
    folder.chmod(0o755)
    (folder / gguf.name).chmod(0o644)
    return folder
