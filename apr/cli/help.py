"""Help that reads like a well-kept CLI: metavars such as CONFIG, N, SIZE, PATH instead of Python
types (`<list[Path]>`, `<int range>`), plain NAME / [NAME] in usage lines (no `{config}`), and
ranges written with the metavar (`N >= 1`). Applied once to the built click tree."""

from __future__ import annotations

from typing import get_args

import click
from typer.core import TyperArgument, TyperOption

# Options whose value is text: the word a user should read in place of <str>.
TEXT_METAVARS = {
    "vocab_size": "SIZE", "seq_len": "N", "builtin_max_bytes": "SIZE", "vram": "SIZE", "gpu": "NAME",
    "resume": "CHECKPOINT", "status": "STATUS", "experiment": "NAME", "runs": "A,B", "metric": "NAME",
    "run": "RUN_ID", "glob": "PATTERN", "text_key": "KEY", "text_column": "COLUMN", "eot_token": "TOKEN",
    "input_column": "COLUMN", "builtin": "NAME", "special_tokens": "TOKEN",
}
SECOND_OPTIONS = ("timeout", "stale_after")
NAMED_METAVARS = {"refresh": "MS", "val_fraction": "F"}  # where the unit says more than the type


class AprArgument(TyperArgument):
    def display_type_rich(self, ctx: click.Context) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")


class AprOption(TyperOption):
    def _get_number_range_help_str(self) -> str | None:
        if self.count and self.min == 0 and self.max is None:
            return None
        name = self.metavar or "x"
        if self.min is not None and self.max is not None:
            return f"{self.min} <= {name} <= {self.max}"
        if self.min is not None:
            return f"{name} >= {self.min}"
        return None if self.max is None else f"{name} <= {self.max}"


def _option_metavar(opt: TyperOption) -> str:
    desc = opt.type_descriptor
    if opt.name in NAMED_METAVARS:
        return NAMED_METAVARS[opt.name]
    if desc.is_choice:
        return "|".join(str(getattr(c, "value", c)) for c in desc.choices)
    if desc.is_path or desc.is_file:
        return "DIR" if desc.path_type == "directory" else "PATH"
    base = get_args(desc.annotation)[0] if desc.is_list and get_args(desc.annotation) else desc.annotation
    if base is int:
        return "N"
    if base is float:
        return "SECONDS" if opt.name in SECOND_OPTIONS else "X"
    return TEXT_METAVARS.get(opt.name or "", (opt.name or "value").upper())


def tidy_help(command: click.Command) -> None:
    """Give every parameter of ``command`` and its subcommands a readable metavar."""
    for param in command.params:
        if isinstance(param, TyperArgument):
            param.__class__ = AprArgument
            if param.metavar is None:
                param.metavar = (param.name or "arg").upper()
        elif isinstance(param, TyperOption) and not param.is_flag and not param.count:
            param.__class__ = AprOption
            if param.metavar is None:
                param.metavar = _option_metavar(param)
    for sub in getattr(command, "commands", {}).values():
        tidy_help(sub)
