"""The README's command table names every command and every option that its --help shows, so that a
reader of the README finds each option there, as a reader of the man page does."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from gemtrace.cli import help_parsers

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[1] / "README.md"


def command_rows() -> dict[str, str]:
    """Each row of the README's `## Commands` table, by the command it opens with."""
    text = README.read_text()
    section = text[text.index("\n## Commands\n"):]
    section = section[:section.index("\n## ", 1)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        match = re.match(r"\| `gemtrace ([a-z-]+)([^`]*)` \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_the_readme_table_names_every_command_and_option() -> None:
    rows = command_rows()
    parsers = {name: p for name, p in help_parsers().items() if name}  # "": gemtrace itself, no options
    assert set(rows) == set(parsers)
    missing = {}
    for name, parser in parsers.items():
        # What --help shows: not --help itself, nor an old spelling it hides (SUPPRESS).
        options = {o for action in parser._actions if action.help != argparse.SUPPRESS
                   for o in action.option_strings if o.startswith("--")} - {"--help"}
        # --[no-]release-cache stands for both spellings, as the usage line writes it.
        named = set(re.findall(r"--[a-z][a-z-]*", rows[name].replace("--[no-]", "--no-").replace(
            "--no-release-cache", "--release-cache --no-release-cache")))
        if options - named:
            missing[name] = sorted(options - named)
    assert missing == {}, f"options missing from README.md's command table: {missing}"
