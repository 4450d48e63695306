"""`apr train validate CONFIG`: schema (and config-only contracts) check, no torch import."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("validate")
    def validate(
        config: Path = typer.Argument(..., help="Training config (YAML).", show_default=False),
        json_out: bool = typer.Option(False, "--json", help="Print findings as JSON."),
    ) -> None:
        """Check a config's schema and its config-only contracts. Exit 0 valid, 1 invalid, 2 usage."""
        from apr.cli.validate_cmd import run_validate

        raise typer.Exit(run_validate(config, json_out))
