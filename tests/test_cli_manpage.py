"""gemtrace(1) as packaging/deb/manpage.py makes it from gemtrace.1.in and the argument parser: every
option that a command's --help shows is in that command's section of the page, the page renders with
man and groff without a warning, and a template that forgets a command stops the build."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gemtrace import __version__
from gemtrace.cli import help_parsers

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "packaging" / "deb" / "manpage.py"
TEMPLATE = REPO / "packaging" / "deb" / "gemtrace.1.in"


def _generate(template: Path = TEMPLATE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), str(template), __version__, "2026-01-02"],
                          capture_output=True, text=True, cwd="/", timeout=60)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = _generate()
    assert out.returncode == 0, out.stderr
    path = tmp_path_factory.mktemp("man") / "gemtrace.1"
    path.write_text(out.stdout)
    return path


def _roff(option: str) -> str:
    return "\\fB" + option.replace("-", "\\-") + "\\fR"


def _sections(text: str) -> dict[str, str]:
    """Each command's subsection (.SS "name") of COMMANDS, and "" for the page's OPTIONS section."""
    options = text.split("\n.SH OPTIONS\n", 1)[1].split("\n.SH ", 1)[0]
    commands = text.split("\n.SH COMMANDS\n", 1)[1].split("\n.SH ", 1)[0]
    parts = re.split(r'^\.SS "(.+)"$', commands, flags=re.M)[1:]
    bodies = {name.replace("\\-", "-"): body for name, body in zip(parts[::2], parts[1::2], strict=True)}
    return {"": "\n" + options} | bodies


def test_every_option_of_every_command_is_in_its_section(page: Path) -> None:
    sections = _sections(page.read_text())
    parsers = help_parsers()
    assert set(sections) == set(parsers)
    checked = 0
    for name, parser in parsers.items():
        for action in parser._actions:
            if action.help is argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            where = sections[""] if isinstance(action, argparse._HelpAction) else sections[name]
            for option in action.option_strings:
                assert f"\n.TP\n{_roff(option)}" in where or f", {_roff(option)}" in where, (name, option)
                checked += 1
            if not action.option_strings:  # a positional: its metavar heads an item
                assert f"\n.TP\n\\fI{action.metavar}" in where or "\n.TP\n\\fB\\-\\-\\fR \\fICMD" in where, name
    # The options the first pages lacked, by name (the loop above would pass on an empty parser).
    assert checked >= 20
    for name, option in [("agent", "--no-ebpf"), ("agent", "--probe-mode"), ("agent", "--log-level"),
                         ("status", "--json"), ("top", "--once"), ("top", "--interval"), ("run", "--config"),
                         ("run", "--state-dir"), ("run", "--require-agent"), ("top", "--listen")]:
        assert f"\n.TP\n{_roff(option)}" in sections[name], (name, option)
    assert "\\-\\-url" not in page.read_text()  # the hidden alias stays hidden


def test_the_prose_of_the_template_is_kept(page: Path) -> None:
    text = page.read_text()
    assert text.startswith(".\\\" gemtrace(1)")
    assert f'.TH GEMTRACE 1 "2026-01-02" "gemtrace {__version__}" "User Commands"' in text
    for heading in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "EXIT STATUS", "FILES",
                    "ENVIRONMENT", "EXAMPLES", "SEE ALSO"):
        assert f"\n.SH {heading}\n" in text, heading
    assert "\n.B 78\n" in text and "RestartPreventExitStatus=" in text
    assert not re.search(r"^@", text, re.M)  # no marker left


def _clean_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "MANWIDTH": "80"}


def test_man_renders_it_without_warnings(page: Path) -> None:
    if shutil.which("man") is None:
        pytest.fail("man is missing: apt-get install man-db", pytrace=False)
    out = subprocess.run(["man", "--warnings", "-l", str(page)], capture_output=True, text=True, env=_clean_env(),
                         timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "gemtrace run --group NAME" in out.stdout
    assert re.search(r"^\s+--require-agent$", out.stdout, re.M), out.stdout


def test_groff_finds_nothing_to_warn_about(page: Path) -> None:
    if shutil.which("groff") is None:
        pytest.fail("groff is missing: apt-get install groff-base", pytrace=False)
    out = subprocess.run(["groff", "-man", "-ww", "-z", "-Tutf8", str(page)], capture_output=True, text=True,
                         env=_clean_env(), timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_a_template_without_a_command_stops_the_build(tmp_path: Path) -> None:
    template = tmp_path / "gemtrace.1.in"
    template.write_text(TEMPLATE.read_text().replace("@OPTIONS status@\n", ""))
    out = _generate(template)
    assert out.returncode != 0 and out.stdout == ""
    assert "the template lacks @OPTIONS status@" in out.stderr, out.stderr


def test_a_template_naming_an_unknown_command_stops_the_build(tmp_path: Path) -> None:
    template = tmp_path / "gemtrace.1.in"
    template.write_text(TEMPLATE.read_text() + "@COMMAND frobnicate@\n")
    out = _generate(template)
    assert out.returncode != 0 and "'frobnicate'" in out.stderr, out.stderr
