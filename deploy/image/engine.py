"""The container engine at hand: docker where its daemon answers, else podman.

Podman runs here as root without systemd and on cgroup v1 (or hybrid)
hierarchies, where crun refuses to start containers: it then gets the
cgroupfs manager and runc, and `run` gets ulimits no higher than this
process's own (podman's defaults exceed them and are refused), with nproc
capped at the kernel's pid_max (a higher one is refused as well), and
docker's unprivileged port 80.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Engine:
    """A container engine's command line: `command` starts every call (the
    binary and its global flags), `run_flags` go after `run`."""

    name: str                      # "docker" | "podman"
    command: tuple[str, ...]
    run_flags: tuple[str, ...]
    build_flags: tuple[str, ...]
    version: str

    def __call__(self, *args: str, timeout: float | None = None, check: bool = True,
                 stream: bool = False) -> subprocess.CompletedProcess:
        """Runs `engine ARGS`: its output captured as text (stdout and stderr
        apart), or with `stream` passed through to ours."""
        capture = {} if stream else {"capture_output": True}
        return subprocess.run([*self.command, *args], text=True, timeout=timeout, check=check, **capture)

    def has_image(self, image: str) -> bool:
        return self("image", "inspect", image, check=False, timeout=60).returncode == 0

    def describe(self) -> str:
        return f"{self.name} {self.version} ({' '.join(self.command)})"


def detect() -> Engine | None:
    """docker if its daemon answers, else podman if installed, else None."""
    docker = shutil.which("docker")
    server = docker and _answers([docker, "info", "--format", "{{.ServerVersion}}"])
    if server:
        return Engine("docker", (docker,), (), (), server)
    podman = shutil.which("podman")
    if podman is None:
        return None
    command = [podman]
    if not Path("/run/systemd/system").exists():
        command += ["--cgroup-manager", "cgroupfs"]
    if not _cgroup_v2() and shutil.which("runc"):
        command += ["--runtime", "runc"]
    version = _answers([podman, "version", "--format", "{{.Client.Version}}"]) or "?"
    # Podman's build drops HEALTHCHECK from OCI images: docker's format keeps it.
    # Builds reach package registries through the host's network.
    # Any uid may bind port 80 in the container's own network namespace, as
    # docker (20.10 and later) lets it by default.
    run_flags = (*_podman_ulimits(), "--sysctl", "net.ipv4.ip_unprivileged_port_start=0")
    return Engine("podman", tuple(command), run_flags, ("--format", "docker", "--network", "host"), version)


def _answers(argv: list[str]) -> str:
    """The command's stripped output, or "" when it fails or hangs."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _cgroup_v2() -> bool:
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


def _podman_ulimits() -> tuple[str, ...]:
    flags = []
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for name, limit in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft, hard = resource.getrlimit(limit)
        cap = pid_max if name == "nproc" else None
        soft, hard = (_bounded(v, cap) for v in (soft, hard))
        flags += ["--ulimit", f"{name}={soft}:{hard}"]
    return tuple(flags)


def _bounded(value: int, cap: int | None) -> int:
    if value == resource.RLIM_INFINITY:
        return cap if cap is not None else 1 << 20
    return min(value, cap) if cap is not None else value
