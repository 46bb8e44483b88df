"""Every command's ``--help`` reads as a command line does: ``plancache tune [OPTIONS] FILES...``, ``--out PATH``,
never Typer's ``{files}...`` or Python types (``<list[Path]>``)."""

from __future__ import annotations

import re

import typer.main
from typer.testing import CliRunner

from plancache.cli import make_app


def _commands(group, path=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name)


def test_every_help_names_arguments_and_options_as_a_command_line_does():
    app = make_app()
    commands = list(_commands(typer.main.get_command(app)))
    assert len(commands) > 20
    runner, bad = CliRunner(), []
    for command in commands:
        out = runner.invoke(app, [*command, "--help"], prog_name="plancache").output
        usage = out.splitlines()[0]
        if not re.fullmatch(r"Usage: plancache [a-z -]+ \[OPTIONS\]( \S.*)?", usage) or "{" in usage:
            bad.append(usage)
        bad += [f"{' '.join(command)}: {line.strip()}" for line in out.splitlines() if re.search(r"<[a-z]+[^>]*>", line)
                and not re.search(r"<name>|<graph_key>|<env_id>|<sha256>|<token>", line)]
    assert not bad, "\n".join(bad)


def test_the_usage_line_and_lists_of_tune_and_keygen():
    app = make_app()
    tune = CliRunner().invoke(app, ["tune", "--help"], prog_name="plancache").output
    assert tune.startswith("Usage: plancache tune [OPTIONS] FILES...\n")
    assert re.search(r"^  FILES\.\.\.\s+GraphSpec JSON files", tune, re.M) and re.search(r"^  --out PATH\s", tune, re.M)
    keygen = CliRunner().invoke(app, ["keygen", "--help"], prog_name="plancache").output
    assert keygen.startswith("Usage: plancache keygen [OPTIONS] [DIR]\n")
    token = CliRunner().invoke(app, ["token", "create", "--help"]).output
    assert "--role [reader|worker|admin]" in token and "--name TEXT" in token


def test_serve_takes_a_log_level():
    serve = CliRunner().invoke(make_app(), ["serve", "--help"]).output
    assert re.search(r"--log-level \[critical\|error\|warning\|info\|debug\|trace\]", serve), serve
    refused = CliRunner().invoke(make_app(), ["serve", "--log-level", "loud"])
    assert refused.exit_code == 2 and "loud" in refused.output
