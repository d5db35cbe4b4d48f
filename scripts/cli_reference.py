"""Write docs/cli.md from the roles' own parsers: the options and the words `--help` shows, so that the reference
cannot drift from the commands (tests/test_docs.py checks that the page is what this writes).

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 when docs/cli.md differs from what it would write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's tools are not installed
PAGE = ROOT / "docs" / "cli.md"


def _commands() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(command in a clone, the installed one, its parser) for each role's command."""
    from hivetrain.roles.coordinator.options import build_parser as coordinator
    from hivetrain.roles.coordinator.tokens import issue_token_parser, revoke_token_parser
    from hivetrain.roles.dashboard.launch import build_parser as dashboard
    from hivetrain.roles.peers.join import build_parser as join

    return [
        ("python coordinator/start.py", "hivetrain-coordinator", coordinator()),
        ("python coordinator/start.py issue-token", "hivetrain-coordinator issue-token", issue_token_parser()),
        ("python coordinator/start.py revoke-token", "hivetrain-coordinator revoke-token", revoke_token_parser()),
        ("python peers/join.py", "hivetrain-join", join()),
        ("make dashboard", "hivetrain-dashboard", dashboard()),
    ]


def _option(action: argparse.Action) -> str:
    """How --help names an option: its flags with their argument (`--port PORT`), or a positional's name."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{flag}`" for flag in action.option_strings)
    metavar = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices
                                 else action.dest.upper())
    suffix = f" {metavar} ..." if action.nargs in ("+", "*") else f" {metavar}"
    return ", ".join(f"`{flag}{suffix}`" for flag in action.option_strings).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    """The help text with its %(default)s and the like filled in, as argparse fills them."""
    params = {name: value for name, value in dict(vars(action), prog=prog).items() if value is not argparse.SUPPRESS}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return ((action.help or "") % params).replace("|", "\\|")


def _section(clone: str, installed: str, parser: argparse.ArgumentParser) -> str:
    lines = [f"## `{installed}`", "", f"In a clone: `{clone}`. {parser.description or ''}".rstrip()]
    for group in parser._action_groups:  # noqa: SLF001 - argparse keeps its groups there, as its own help does
        actions = [a for a in group._group_actions  # noqa: SLF001
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]  # noqa: SLF001
        if not actions:
            continue
        title = "arguments" if group.title in ("positional arguments", "options") else group.title
        lines += ["", f"**{title}**", "", "| option | meaning |", "|---|---|"]
        lines += [f"| {_option(action)} | {_help(action, parser.prog)} |" for action in actions]
    return "\n".join(lines) + "\n"


def render() -> str:
    commands = _commands()
    toc = "\n".join(f"- [`{installed}`](#{installed.replace(' ', '-')})" for _, installed, _ in commands)
    sections = "\n".join(_section(*command) for command in commands)
    return (f"# Command-line reference\n\nEvery role's options, written from the commands' own `--help` by"
            f" `python scripts/cli_reference.py`. Back to the [README](../README.md).\n\n{toc}\n\n{sections}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/cli_reference.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether docs/cli.md is up to date")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        print(f"{PAGE.relative_to(ROOT)} is {'up to date' if current == page else 'out of date'}")
        return 0 if current == page else 1
    PAGE.write_text(page)
    print(f"Wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
