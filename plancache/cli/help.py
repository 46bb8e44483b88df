"""How ``plancache COMMAND --help`` names arguments and options: ``FILES...``, ``[DIR]``, ``--out PATH``.

Typer writes a required argument as ``{files}...`` in the usage line and each parameter with its Python type
(``<list[Path]>``); :class:`HelpCommand` names them as click does, keeping Typer's help texts."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand


def _argument(param: Any) -> str:
    """``FILES...``, ``[DIR]``: the argument's metavar (its name in capitals), repeated and optional as it is."""
    name = param.metavar or param.name.upper()
    if param.nargs != 1 and not name.endswith("..."):
        name += "..."
    return name if param.required else f"[{name}]"


#: Typer's type labels, as click names them.
_KINDS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "path": "PATH", "bool": "BOOLEAN"}


def _option(typer_name: str) -> str:
    """``--out PATH``, ``--role [reader|worker|admin]``: Typer's ``--out <path>``, its type as click writes it."""
    flags, _, label = typer_name.partition(" <")
    if not label:
        return flags  # a flag takes no value
    kind = label.removesuffix(">").removeprefix("list[").removesuffix("]").removesuffix(" range")
    return f"{flags} {_KINDS.get(kind) or (f'[{kind}]' if '|' in kind else kind.upper())}"


class HelpCommand(TyperCommand):
    """A Typer command whose usage line reads ``plancache tune [OPTIONS] FILES...``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [_argument(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        rows: dict[str, list[tuple[str, str]]] = {"argument": [], "option": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)  # Typer's: the help text, with the default and bounds
            if record is not None and param.param_type_name in rows:
                name = _argument(param) if param.param_type_name == "argument" else _option(record[0])
                rows[param.param_type_name].append((name, record[1]))
        for title, kind in (("Arguments", "argument"), ("Options", "option")):
            if rows[kind]:
                with formatter.section(title):
                    formatter.write_dl(rows[kind])


def use_plain_help(app: typer.Typer) -> None:
    """Make every command of ``app`` and of its sub-apps a :class:`HelpCommand` (those given no class of their own)."""
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = HelpCommand
    for group in app.registered_groups:
        if group.typer_instance is not None:
            use_plain_help(group.typer_instance)
