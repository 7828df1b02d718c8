"""`make image`: builds the server's image with docker or podman, whichever
is present, and says which.

    python -m deploy.image.build [--device cpu] [--tag tgi-py:cpu] [--torch-wheels DIR]

The CPU image starts from `ubuntu:24.04` where that can be had (already
local, or pulled); where no registry answers, from a Debian base that
debian-base.sh makes with debootstrap. A torch wheel of the Dockerfile's
TORCH_VERSION in --torch-wheels (by default pip's own find-links:
PIP_FIND_LINKS, or pip's configured `find-links`) is installed instead of
PyTorch's index's. The certificates that pip trusts here (PIP_CERT, or pip's
configured `cert`) are trusted by the build's pip as well (behind a proxy
that inspects TLS), without entering the image.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .engine import Engine, detect

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_BASE = "localhost/tgi-py-base:bookworm"
DEFAULT_TAG = {"cpu": "tgi-py:cpu", "cuda": "tgi-py:latest"}


def dockerfile_arg(name: str) -> str:
    """A global ARG's default in the Dockerfile."""
    match = re.search(rf'^ARG {name}="?([^"\n]*)"?$', (ROOT / "Dockerfile").read_text(), re.M)
    if match is None:
        raise KeyError(name)
    return match.group(1)


def cpu_base(engine: Engine) -> str:
    """The Dockerfile's CPU base if it is local or can be pulled, else the
    local Debian base (made once)."""
    default = dockerfile_arg("CPU_BASE_IMAGE")
    if engine.has_image(default) or engine("pull", default, check=False, timeout=600).returncode == 0:
        return default
    if not engine.has_image(DEBIAN_BASE):
        print(f"{default} cannot be pulled: making {DEBIAN_BASE} with debootstrap", flush=True)
        subprocess.run(["bash", str(ROOT / "deploy/image/debian-base.sh"), " ".join(engine.command), DEBIAN_BASE],
                       check=True)
    return DEBIAN_BASE


def torch_wheels(folders: list[str]) -> list[Path]:
    """The torch wheels of the Dockerfile's TORCH_VERSION (every Python tag:
    the build takes its base's) in the first of FOLDERS that has any."""
    version = dockerfile_arg("TORCH_VERSION")
    for folder in folders:
        wheels = sorted(Path(folder).glob(f"torch-{version}[+-]*.whl")) if Path(folder).is_dir() else []
        if wheels:
            return wheels
    return []


def pip_setting(name: str) -> str:
    """pip's own setting NAME on this machine: PIP_NAME, else `global.NAME`
    from its configuration files, all of them merged ("" where unset)."""
    if value := os.environ.get(f"PIP_{name.upper().replace('-', '_')}"):
        return value
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    values = re.findall(rf"^global\.{re.escape(name)}='(.*)'$", listed, re.M)
    return values[-1] if values else ""


def pip_cert() -> Path | None:
    """The CA bundle pip trusts on this machine, if one is configured."""
    named = pip_setting("cert")
    return Path(named) if named and Path(named).is_file() else None


def build_image(engine: Engine, device: str = "cpu", tag: str | None = None, wheel_folders: list[str] | None = None,
                extra: list[str] = (), dockerfile: Path = ROOT / "Dockerfile",
                stream: bool = False) -> subprocess.CompletedProcess:
    """Builds DEVICE's image as TAG; returns the finished build, its output
    captured unless `stream`. WHEEL_FOLDERS: where to look for torch wheels
    (None: pip's own find-links). Raises CalledProcessError on failure."""
    tag = tag or DEFAULT_TAG[device]
    args = ["build", *engine.build_flags, "-f", str(dockerfile), "-t", tag, "--build-arg", f"DEVICE={device}"]
    if device == "cpu":
        args += ["--build-arg", f"CPU_BASE_IMAGE={cpu_base(engine)}"]
    with tempfile.TemporaryDirectory(prefix="tgi-py-build.") as tmp:
        # The Dockerfile's named contexts torch-wheels and build-ca, holding only
        # what they are for: the build sends no more.
        wheels = torch_wheels(pip_setting("find-links").split() if wheel_folders is None else wheel_folders)
        for wheel in wheels:
            _link_or_copy(wheel, Path(tmp, "torch-wheels", wheel.name))
        if wheels:
            args += ["--build-context", f"torch-wheels={tmp}/torch-wheels"]
        cert = pip_cert()
        if cert is not None:
            _link_or_copy(cert, Path(tmp, "build-ca", "ca.crt"))
            args += ["--build-context", f"build-ca={tmp}/build-ca"]
        args += [*extra, str(ROOT)]
        print(f"{' '.join(engine.command)} {' '.join(args)}", flush=True)
        return engine(*args, stream=stream)


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tag", help="image name (default: tgi-py:cpu, or tgi-py:latest for cuda)")
    parser.add_argument("--torch-wheels", action="append",
                        help="a folder with a torch wheel to install (default: pip's find-links)")
    parser.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    args = parser.parse_args(argv)
    engine = detect()
    if engine is None:
        print("neither docker (with a running daemon) nor podman is installed", file=sys.stderr)
        return 1
    print(f"building with {engine.describe()}", flush=True)
    start = time.monotonic()
    try:
        build_image(engine, args.device, args.tag, args.torch_wheels, ["--no-cache"] if args.no_cache else [],
                    stream=True)
    except subprocess.CalledProcessError as e:
        print(f"image build failed ({engine.name}, exit {e.returncode})", file=sys.stderr)
        return 1
    print(f"built {args.tag or DEFAULT_TAG[args.device]} with {engine.name} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
