"""`apr train validate CONFIG`: schema (and config-only contracts) check, no torch import.

Importable without typer (typer is imported inside `register`), so the CI fast path stays quick."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer


def run_validate(config: Path, json_out: bool) -> int:
    """Validate ``config``; print findings (text or JSON); return the exit code (0 valid, 1 invalid)."""
    from apr.cli.render import findings_json, print_error, print_findings
    from apr.config import load_config
    from apr.errors import ConfigError
    from apr.plan.validate import config_findings

    try:
        loaded = load_config(config)
        findings = config_findings(loaded)
    except ConfigError as err:
        if json_out:
            print(findings_json(err.findings, file=str(config), valid=False))
        else:
            print_error(err)
        return 1
    errors = [f for f in findings if f.severity == "error"]
    if json_out:
        print(findings_json(findings, file=str(config), valid=not errors))
    else:
        print_findings(findings)
        n_warn = sum(f.severity == "warning" for f in findings)
        verdict = "invalid" if errors else "valid"
        print(f"{config}: {verdict} ({len(errors)} errors, {n_warn} warnings)")
    return 1 if errors else 0


def fast_path(argv: list[str]) -> int | None:
    """Handle `apr train validate CONFIG [--json]` without building the typer app (~0.15 s saved,
    since validate runs in CI on every push). Returns None when argv is anything else."""
    if len(argv) < 3 or argv[:2] != ["train", "validate"]:
        return None
    rest = argv[2:]
    json_out = "--json" in rest
    paths = [a for a in rest if a != "--json"]
    if len(paths) != 1 or paths[0].startswith("-"):
        return None  # let typer produce its usage errors and help
    return run_validate(Path(paths[0]), json_out)


def register(app: typer.Typer) -> None:
    import typer

    @app.command("validate")
    def validate(
        config: Path = typer.Argument(..., metavar="CONFIG", help="Training config (YAML).", show_default=False),
        json_out: bool = typer.Option(False, "--json", help="Print findings as JSON."),
    ) -> None:
        """Check a config's schema and its config-only contracts. Exit 0 valid, 1 invalid, 2 usage."""
        raise typer.Exit(run_validate(config, json_out))
