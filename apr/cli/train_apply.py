"""Placeholder: the owning issue fills in this command module."""

import typer


def register(app: typer.Typer) -> None:
    return None
