"""The Dockerfile, checked without Docker: BuildKit's own parser (the
`dockerfile` package wraps it) reads it, its stages resolve for both the CUDA
and the CPU build, and it follows TGI's image conventions."""

import fnmatch
import re

import dockerfile
import pytest

from tgi_router.launch.config import build_parser
from tgi_router.launch.flags_doc import accepted_options

from .doc_snippets import ROOT

COMMANDS = dockerfile.parse_file(str(ROOT / "Dockerfile"))


def instructions(cmd: str) -> list[dockerfile.Command]:
    return [c for c in COMMANDS if c.cmd == cmd.upper()]


def stages() -> dict[str, tuple[str, list[dockerfile.Command]]]:
    """stage name -> (its FROM argument, its instructions)."""
    found, current = {}, None
    for c in COMMANDS:
        if c.cmd == "FROM":
            current = c.value[2] if len(c.value) == 3 else f"#{len(found)}"
            found[current] = (c.value[0], [])
        elif current is not None:
            found[current][1].append(c)
    return found


def global_args() -> dict[str, str]:
    args = {}
    for c in COMMANDS:
        if c.cmd == "FROM":
            break
        name, _, value = c.value[0].partition("=")
        args[name] = value.strip('"')
    return args


def expander(device: str):
    """Substitutes the global ARGs (with DEVICE=device) into a FROM or --from."""
    args = {**global_args(), "DEVICE": device}
    return lambda text: re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def sources(command: dockerfile.Command) -> list[str]:
    """The stages or images an instruction reads: COPY --from=X, RUN --mount=...,from=X."""
    found = [f.split("=", 1)[1] for f in command.flags if command.cmd == "COPY" and f.startswith("--from=")]
    for flag in command.flags:
        if command.cmd == "RUN" and flag.startswith("--mount="):
            found += [part.split("=", 1)[1] for part in flag.removeprefix("--mount=").split(",")
                      if part.startswith("from=")]
    return found


def reachable_stages(device: str) -> set[str]:
    """The stages a build of the last stage with DEVICE=device runs."""
    expand, graph = expander(device), stages()
    seen, todo = set(), [list(graph)[-1]]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        source, body = graph[name]
        todo += [s for s in [expand(source)] if s in graph]
        todo += [expand(s) for c in body for s in sources(c)]
    return seen


def external_images(device: str) -> set[str]:
    """The images from a registry that a DEVICE=device build starts from
    (scratch is none: it is empty and never pulled)."""
    expand, graph = expander(device), stages()
    return {expand(graph[s][0]) for s in reachable_stages(device)
            if expand(graph[s][0]) not in graph and graph[s][0] != "scratch"}


INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def test_buildkit_parser_reads_only_known_instructions():
    # The parser itself rejects malformed instructions (ENV without a value,
    # an unterminated heredoc) but not unknown ones: those are checked here.
    assert COMMANDS[0].cmd == "ARG" and instructions("FROM")
    assert {c.cmd for c in COMMANDS} <= INSTRUCTIONS


def test_entrypoint_is_the_launcher_in_exec_form():
    (entrypoint,) = instructions("ENTRYPOINT")
    assert entrypoint.json and list(entrypoint.value) == ["text-generation-launcher"]


def test_default_arguments_are_launcher_flags():
    (cmd,) = instructions("CMD")
    assert cmd.json and set(cmd.value) <= accepted_options()
    build_parser().parse_args(list(cmd.value))


@pytest.mark.parametrize("name, value", [("PORT", "80"), ("HF_HOME", "/data")])
def test_tgi_environment(name, value):
    env = {}
    for c in instructions("ENV"):
        env.update(zip(c.value[::2], c.value[1::2]))
    assert env[name] == value


def test_data_volume_and_port_80():
    assert [c.value for c in instructions("VOLUME")] == [("/data",)]
    assert [c.value for c in instructions("EXPOSE")] == [("80",)]


def test_healthcheck_probes_health_on_the_served_port():
    (check,) = instructions("HEALTHCHECK")
    assert check.value[0] == "CMD"
    assert "/health" in check.value[1] and "${PORT" in check.value[1] and "curl -f" in check.value[1]
    # Podman runs the check without HOSTNAME in its environment.
    assert "${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}" in check.value[1]


def test_cuda_build_starts_from_cuda_images_and_builds_flash_attn():
    images = external_images("cuda")
    assert images and all(i.startswith("nvidia/cuda:") for i in images)
    assert "flash-attn-cuda" in reachable_stages("cuda")
    assert any("flash-attn==" in c.value[0] for c in stages()["flash-attn-cuda"][1] if c.cmd == "RUN")
    assert re.search(r"CUDA_ARCHS=\"?8\.0;8\.6;8\.9;9\.0", (ROOT / "Dockerfile").read_text())


def test_base_images_are_build_arguments_that_default_to_the_registrys():
    args = global_args()
    assert [stages()[name][0] for name in ("base-cpu", "base-cuda", "flash-attn-cuda")] == [
        "${CPU_BASE_IMAGE}", "${CUDA_BASE_IMAGE}", "${CUDA_DEVEL_IMAGE}"]
    assert args["CPU_BASE_IMAGE"] == "ubuntu:24.04"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl"


def test_cuda_images_do_not_drift_from_each_other_or_from_the_cpu_base():
    """The venv built on the CUDA base runs flash-attn's build on the devel
    image, and the CPU image has the same Ubuntu: one Python for all three."""
    args = global_args()
    base = re.fullmatch(r"nvidia/cuda:([\d.]+)-base-ubuntu([\d.]+)", args["CUDA_BASE_IMAGE"])
    devel = re.fullmatch(r"nvidia/cuda:([\d.]+)-cudnn-devel-ubuntu([\d.]+)", args["CUDA_DEVEL_IMAGE"])
    assert base and devel and base.groups() == devel.groups()
    assert args["CPU_BASE_IMAGE"] == f"ubuntu:{base.group(2)}"


def test_cpu_and_cuda_images_share_every_stage_but_their_base_and_flash_attn():
    shared = reachable_stages("cpu") & reachable_stages("cuda")
    assert {"python", "torch", "requirements", "runtime", "torch-wheels", "build-ca"} <= shared
    assert reachable_stages("cpu") - shared == {"base-cpu", "flash-attn-cpu"}
    assert reachable_stages("cuda") - shared == {"base-cuda", "flash-attn-cuda"}
    # torch is installed once, in the shared stage; flash-attn's build takes that venv.
    installs = [c for c in COMMANDS if c.cmd == "RUN" and 'pip install "torch==' in c.value[0]]
    assert len(installs) == 1 and installs[0] in stages()["torch"][1]
    assert any(c.cmd == "COPY" and "--from=torch" in c.flags for c in stages()["flash-attn-cuda"][1])


def test_cpu_build_uses_no_cuda_image_and_the_cpu_torch():
    assert external_images("cpu") == {global_args()["CPU_BASE_IMAGE"]}
    assert "flash-attn-cuda" not in reachable_stages("cpu")
    (torch_run,) = [c for c in stages()["torch"][1] if c.cmd == "RUN"]
    assert 'if [ "$DEVICE" = "cpu" ]; then index=cpu' in torch_run.value[0]
    assert '--index-url "${TORCH_INDEX_URL}/${index}"' in torch_run.value[0]


def test_a_local_torch_wheel_and_build_certificates_are_mounted_never_copied():
    """torch-wheels and build-ca are empty stages that `--build-context`
    replaces; the RUNs that download read them through bind mounts."""
    for name in ("torch-wheels", "build-ca"):
        assert stages()[name] == ("scratch", [])
        assert not [c for c in COMMANDS if c.cmd == "COPY" and f"--from={name}" in c.flags]
    downloads = [c for c in COMMANDS if c.cmd == "RUN" and re.search(r"pip (install|wheel)", c.value[0])]
    assert downloads and all("build-ca" in sources(c) for c in downloads)
    (torch_run,) = [c for c in stages()["torch"][1] if c.cmd == "RUN"]
    assert "torch-wheels" in sources(torch_run)


def test_layers_go_from_dependencies_to_source():
    runtime = stages()["runtime"][1]
    position = lambda test: next(i for i, c in enumerate(runtime) if test(c))  # noqa: E731
    requirements = position(lambda c: c.cmd == "COPY" and "--from=requirements" in c.flags)
    dependencies = position(lambda c: c.cmd == "RUN" and "-r /tmp/requirements.txt" in c.value[0])
    flash_attn = position(lambda c: c.cmd == "COPY" and "--from=flash-attn" in c.flags)
    kernels = position(lambda c: c.cmd == "COPY" and c.value[0] == "kernels")
    kernels_build = position(lambda c: c.cmd == "RUN" and "tgi_kernels.native import build" in c.value[0])
    pyproject = position(lambda c: c.cmd == "COPY" and c.value[0] == "pyproject.toml")
    source = position(lambda c: c.cmd == "COPY" and c.value[0] in ("proto", "router", "server"))
    project = position(lambda c: c.cmd == "RUN" and "pip install --no-deps ." in c.value[0])
    assert requirements < dependencies < flash_attn < kernels < kernels_build < pyproject < source < project
    # The C++ kernels compile from their own source alone: an edit elsewhere reuses that layer.
    assert not [c for c in runtime[kernels + 1:kernels_build] if c.cmd == "COPY"]
    # The dependencies' layer is keyed by the list cut from pyproject.toml, not by the whole file.
    assert not [c for c in runtime[:dependencies] if c.cmd == "COPY" and not c.flags]


def test_no_secret_is_baked_in():
    for c in instructions("ARG") + instructions("ENV"):
        names = [c.value[0].split("=")[0]] if c.cmd == "ARG" else list(c.value[::2])
        assert not [n for n in names if re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", n)], c.original


def test_copied_sources_exist_and_pass_dockerignore():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert {".git", ".venv", ".env"} <= set(ignored)
    for c in instructions("COPY"):
        if c.flags:
            continue
        for source in c.value[:-1]:
            assert (ROOT / source).exists(), source
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
