"""The flags reference is generated from the launcher's parser, and every
launcher flag the documentation shows is one the launcher accepts."""

import argparse
import re

from tgi_router.launch import flags_doc

from .doc_snippets import ROOT, launcher_commands, launcher_flags, markdown_files

REFERENCE = ROOT / "docs" / "reference" / "launcher.md"
# Flags of other programs that the docs quote in backticks.
OTHER_TOOLS = {"--gpus", "--shm-size", "--user", "--build-arg", "--target", "--profile", "--init",
               "--replicas", "--from-literal", "--no-deps", "--config.file", "--index-url",
               "--health-start-period", "--build-context", "--sysctl",
               "--no-repack"}  # the last: llama-server's, in the peers benchmark
# Pages that describe the shard process, and so quote text-generation-server's own options.
SHARD_PAGES = {"architecture.md", "benchmarks.md", "testing.md", "quantization_and_sharding.md", "features.md",
               "models.md"}
INLINE_FLAG = re.compile(r"`(--[a-z][a-z0-9.-]*)[ =`]")


def test_reference_page_matches_the_parser():
    assert REFERENCE.read_text() == flags_doc.render(), \
        "docs/reference/launcher.md is stale: python -m tgi_router.launch.flags_doc > docs/reference/launcher.md"


def test_reference_page_lists_every_accepted_option():
    text = REFERENCE.read_text()
    assert all(f"`{option}`" in text for option in flags_doc.accepted_options())


def test_reference_page_names_each_flags_environment_variable():
    text = REFERENCE.read_text()
    assert "| `--max-total-tokens` | `MAX_TOTAL_TOKENS` |" in text
    assert "| `--model-id`, `--model` | `MODEL_ID` |" in text


def test_launcher_command_lines_in_docs_use_accepted_flags():
    accepted = flags_doc.accepted_options()
    commands = launcher_commands()
    assert commands, "the docs show how to start the launcher"
    for command in commands:
        unknown = set(launcher_flags(command.argv())) - accepted
        assert not unknown, f"{command.where}: {unknown}"


def shard_options() -> set[str]:
    """text-generation-server's options, every subcommand (the pages on the
    shard's internals quote them)."""
    from tgi_server.cli import build_parser

    found, parsers = set(), [build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            found |= set(action.option_strings)
            parsers.extend(getattr(action, "choices", None).values()
                           if isinstance(action, argparse._SubParsersAction) else ())
    return found


def test_flags_quoted_in_docs_prose_are_accepted():
    for path in markdown_files():
        if path == REFERENCE:
            continue
        accepted = flags_doc.accepted_options() | OTHER_TOOLS
        if path.name in SHARD_PAGES:
            accepted |= shard_options()
        unknown = set(INLINE_FLAG.findall(path.read_text())) - accepted
        assert not unknown, f"{path.relative_to(ROOT)}: {unknown}"
