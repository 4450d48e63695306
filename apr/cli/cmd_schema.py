"""`apr schema`: print the config's JSON Schema (for editors' yaml-language-server)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("schema")
    def schema() -> None:
        """Print the JSON Schema of the training config file."""
        import json

        from apr.config.schema import AprConfig

        doc = AprConfig.model_json_schema()
        doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        doc["title"] = "apr training config"
        typer.echo(json.dumps(doc, indent=2))
