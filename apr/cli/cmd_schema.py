"""`apr schema`: print the config's JSON Schema (for editors' yaml-language-server)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("schema")
    def schema() -> None:
        """Print the JSON Schema of the training config file."""
        from apr.config.docgen import render_schema

        typer.echo(render_schema(), nl=False)
