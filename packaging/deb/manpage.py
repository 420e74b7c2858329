"""gemtrace(1) from the argument parser: what build.sh installs as the man page.

    python3 packaging/deb/manpage.py TEMPLATE [VERSION DATE] > gemtrace.1

The prose (DESCRIPTION, EXIT STATUS, FILES, ENVIRONMENT, EXAMPLES, SEE ALSO) is written in TEMPLATE
(packaging/deb/gemtrace.1.in); the synopsis, each command's description and every option come from
gemtrace.cli.help_parsers(), the parsers whose --help each command prints, so the page cannot drift
from the command. A command the template has no @COMMAND/@OPTIONS lines for, or lines for a command
that does not exist, stops the build. Runs at build time only: it is not part of the package.

Debian 12's python3-argparse-manpage (1.2.2) was tried first: it prints the usage text unescaped,
names option values after their dest instead of their metavar, and takes prose only as plain text,
so it could not keep this page's markup; this walker is the 150 lines that do.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gemtrace import __version__  # noqa: E402  (the checkout's package, above)
from gemtrace.cli import help_parsers  # noqa: E402

MARKER = re.compile(r"^@(SYNOPSIS|OPTIONS|COMMAND)(?: (\S+))?@$")


def escape(text: str) -> str:
    """Plain text as roff: backslashes and hyphens escaped, `code` in bold, no line read as a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    text = re.sub(r"`([^`]+)`", r"\\fB\1\\fR", text)
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.splitlines())


def _metavar(text: str) -> str:
    """A metavar as roff: the values to fill in (upper-case words) in italics, `--` in bold."""
    text = escape(text)
    text = re.sub(r"(?<![\\\w])([A-Z][A-Z0-9_]*(?::[A-Z][A-Z0-9_]*)*)", r"\\fI\1\\fR", text)
    return re.sub(r"(?:^|(?<= ))\\-\\-(?= |$)", r"\\fB\\-\\-\\fR", text)


def _documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions --help shows, but -h/--help, which the OPTIONS section names once for all."""
    return [a for a in parser._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def _value(action: argparse.Action) -> str:
    """What an option takes, as roff ('' for a flag)."""
    if action.nargs == 0:
        return ""
    if action.choices is not None and action.metavar is None:
        return "{" + ",".join(f"\\fB{escape(str(c))}\\fR" for c in action.choices) + "}"
    metavar = action.metavar or action.dest.upper()
    return _metavar(" ".join(metavar) if isinstance(metavar, tuple) else metavar)


def _invocation(action: argparse.Action, sep: str = " ") -> str:
    value = _value(action)
    if not action.option_strings:  # a positional
        return value
    return ", ".join(f"\\fB{escape(o)}\\fR" + (sep + value if value else "") for o in action.option_strings)


def _usage(name: str, parser: argparse.ArgumentParser) -> str:
    """`gemtrace NAME [--opt VALUE]... ARGS` as one filled paragraph; each bracket stays on one line."""
    words = []
    for action in _documented(parser):
        # The shortest spelling, as argparse's usage has it.
        short = min(action.option_strings, key=len) if action.option_strings else None
        value = _value(action)
        word = value if short is None else f"\\fB{escape(short)}\\fR" + (f"\\~{value}" if value else "")
        optional = (short is not None and not action.required) or action.nargs == "?"
        words.append(f"[{word}]" if optional else word)
    command = f"gemtrace {name}" if name else "gemtrace"
    # \% keeps a word whole (no hyphenation), \~ keeps an option with its value on one line, and the
    # lines are left-aligned (.ad l), not stretched to the margin.
    line = " ".join("\\%" + w.replace(" ", "\\~") for w in words)
    return f".ad l\n.B {escape(command)}\n{line}\n.ad"


def _options(parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    items = []
    for action in _documented(parser):
        help_text = formatter._expand_help(action) if action.help else ""
        items.append(f".TP\n{_invocation(action)}\n{escape(help_text)}".rstrip("\n"))
    return "\n".join(items) if items else "No options but\n.BR \\-h ,\n.BR \\-\\-help ."


def render(template: str, version: str, date: str) -> str:
    parsers = help_parsers()
    commands = {name: p for name, p in parsers.items() if name}
    seen: dict[str, set[str]] = {"OPTIONS": set(), "COMMAND": set()}
    out = []
    for line in template.replace("@VERSION@", version).replace("@DATE@", date).splitlines():
        match = MARKER.match(line)
        if not match:
            out.append(line)
            continue
        kind, name = match.group(1), match.group(2) or ""
        if kind == "SYNOPSIS":
            out.append("\n.br\n".join(_usage(n, p) for n, p in commands.items()))
            continue
        if name not in parsers:
            raise SystemExit(f"manpage.py: the template names a command {name!r} that gemtrace does not have")
        seen[kind].add(name)
        if kind == "OPTIONS" and not name:
            out.append(_options(parsers[""]))
            out.append(".TP\n\\fB\\-h\\fR, \\fB\\-\\-help\\fR\n"
                       "Print the options of gemtrace, or of a command, and exit (every command takes it).")
        elif kind == "OPTIONS":
            out.append(_options(parsers[name]))
        else:
            parser = parsers[name]
            out.append(f'.SS "{escape(name)}"\n{_usage(name, parser)}\n.PP\n{escape(parser.description or "")}')
    missing = [f"@{kind} {name}@" for kind in seen for name in commands if name not in seen[kind]]
    if "" not in seen["OPTIONS"]:
        missing.append("@OPTIONS@")
    if missing:
        raise SystemExit(f"manpage.py: the template lacks {', '.join(missing)}: add the command's prose there")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    template = Path(argv[0]).read_text()
    version, date = (argv[1], argv[2]) if len(argv) == 3 else (__version__, "")
    sys.stdout.write(render(template, version, f'"{date}"'))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
