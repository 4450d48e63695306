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
        from apr.cli.render import findings_json, print_findings
        from apr.config import load_config
        from apr.errors import ConfigError
        from apr.plan.validate import config_findings

        try:
            loaded = load_config(config)
            findings = config_findings(loaded)
        except ConfigError as err:
            if json_out:
                typer.echo(findings_json(err.findings, file=str(config), valid=False))
            else:
                typer.echo(f"error: {err.message}", err=True)
                print_findings(err.findings)
            raise typer.Exit(1) from None
        errors = [f for f in findings if f.severity == "error"]
        if json_out:
            typer.echo(findings_json(findings, file=str(config), valid=not errors))
        else:
            print_findings(findings)
            n_warn = sum(f.severity == "warning" for f in findings)
            verdict = "invalid" if errors else "valid"
            typer.echo(f"{config}: {verdict} ({len(errors)} errors, {n_warn} warnings)")
        raise typer.Exit(1 if errors else 0)
