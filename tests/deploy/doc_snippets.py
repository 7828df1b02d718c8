"""What the documentation shows users to type, pulled out of its Markdown so
that tests can run or check it: curl examples and launcher command lines."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The host:port curl examples use (the first one in docs/, as TGI's docs do).
DOC_HOSTS = ("localhost:8080", "127.0.0.1:8080")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_LAUNCHER_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-p|-e)(?=[\s=\"']|$)")


@dataclass(frozen=True)
class Snippet:
    """One command from a code block: `where` is `path:line` for test ids."""
    where: str
    text: str       # continuation lines joined

    def argv(self) -> list[str]:
        return shlex.split(self.text)


def markdown_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def commands(path: Path) -> list[Snippet]:
    """Each shell command in the fenced code blocks of `path`, with its
    backslash-continued lines joined."""
    text = path.read_text()
    found = []
    for block in _FENCE.finditer(text):
        line = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", line
        for offset, raw in enumerate(block.group(1).splitlines()):
            if not pending:
                start = line + offset
            stripped = raw.strip()
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            command = (pending + stripped).strip()
            pending = ""
            if command and not command.startswith("#"):
                found.append(Snippet(f"{path.relative_to(ROOT)}:{start}", command))
    return found


def curl_examples() -> list[Snippet]:
    return [s for p in markdown_files() for s in commands(p) if s.text.startswith("curl ")]


def launcher_flags(argv: list[str]) -> list[str]:
    """The flags given to text-generation-launcher in a command: those after
    `text-generation-launcher`, or after the image (`tgi-py...`) of a
    `docker run`. A `docker run` of another image is a ValueError."""
    if "text-generation-launcher" in argv:
        argv = argv[argv.index("text-generation-launcher") + 1:]
    elif argv[:2] == ["docker", "run"]:
        images = [i for i, a in enumerate(argv) if a.startswith("tgi-py")]
        if not images:
            raise ValueError(f"docker run of an image that is not tgi-py: {shlex.join(argv)}")
        argv = argv[images[0] + 1:]
    return [a.split("=", 1)[0] for a in argv if _LAUNCHER_FLAG.fullmatch(a.split("=", 1)[0])]


def launcher_commands() -> list[Snippet]:
    """Commands that start the launcher, directly or through `docker run`."""
    return [s for p in markdown_files() for s in commands(p)
            if "text-generation-launcher" in s.text or s.text.startswith("docker run")]
