"""`apr train validate CONFIG`: schema (and config-only contracts) check, no torch import.

Importable without typer (typer is imported inside `register`), so the CI fast path stays quick."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from apr.cli.ghactions import emit, summary_markdown
from apr.cli.render import findings_json, print_error, print_findings
from apr.errors import ConfigError, Finding

if TYPE_CHECKING:
    import typer


FORMATS = ("text", "json", "github")


def output_format(fmt: str | None, json_out: bool) -> str:
    """``--format`` with ``--json`` as its alias; a contradiction or an unknown name is a usage error."""
    import typer

    if fmt is not None and fmt not in FORMATS:
        raise typer.BadParameter(f"expected one of {', '.join(FORMATS)}, got {fmt!r}", param_hint="'--format'")
    if json_out and fmt not in (None, "json"):
        raise typer.BadParameter(f"--json asks for json, --format for {fmt}: give one",
                                 param_hint="'--format'")
    return "json" if json_out else (fmt or "text")


def run_validate(config: Path, fmt: str = "text", settings: list[str] | None = None, strict: bool = False) -> int:
    """Validate ``config``; print findings (text, JSON or GitHub annotations); return the exit code
    (0 valid, 1 invalid; with ``strict`` a warning fails it too). Schema errors come with the
    findings of every check whose inputs are valid."""
    from apr.config.loader import PartialConfig, load_config_partial
    from apr.plan.validate import config_findings

    error = None
    try:
        loaded = load_config_partial(config, settings)
        if isinstance(loaded, PartialConfig):
            error = loaded.error
            findings = [*error.findings, *(config_findings(loaded.loaded, tainted=loaded.tainted)
                                           if loaded.loaded is not None else [])]
        else:
            findings = config_findings(loaded)
    except ConfigError as err:
        if fmt == "text":
            print_error(err)
            return 1
        findings, error = err.findings or [_unlocated(err, config)], err
    valid = error is None and not any(f.severity == "error" for f in findings)
    n_warn = sum(f.severity == "warning" for f in findings)
    passed = valid and not (strict and n_warn)
    if fmt == "json":
        print(findings_json(findings, file=str(config), valid=valid, strict=strict, passed=passed))
    elif fmt == "github":
        n_err = sum(f.severity == "error" for f in findings)
        verdict = (("valid" if passed else "warnings (--strict)") if valid else "invalid") + (
            f" ({n_err} errors, {len(findings) - n_err} other findings)")
        emit(findings, summary_markdown(f"apr train validate {config}", verdict, findings, str(config)),
             str(config), sys.stdout)
    else:
        if error is not None:  # the schema errors under their heading, then what else was found
            print_error(error)
        print_findings(findings[len(error.findings):] if error is not None else findings)
        n_err = sum(f.severity == "error" for f in findings)
        verdict = ("valid" if passed else "fails --strict: warnings") if valid else "invalid"
        print(f"{config}: {verdict} ({n_err} errors, {n_warn} warnings)")
    return 0 if passed else 1


def _unlocated(err, config: Path):

    return Finding(severity="error", code="config.error", message=err.message, file=str(config))


def fast_path(argv: list[str]) -> int | None:
    """Handle `apr train validate CONFIG [--json | --format F]` without building the typer app
    (~0.15 s saved, since validate runs in CI on every push). Returns None when argv is anything
    else (typer then produces its usage errors and help)."""
    if len(argv) < 3 or argv[:2] != ["train", "validate"]:
        return None
    rest, fmt, json_out, strict, paths = argv[2:], None, False, False, []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--json":
            json_out = True
        elif a == "--strict":
            strict = True
        elif a == "--format" and i + 1 < len(rest):
            fmt, i = rest[i + 1], i + 1
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
        else:
            paths.append(a)
        i += 1
    if not paths or any(p.startswith("-") for p in paths) or fmt not in (None, *FORMATS) or (
            json_out and fmt not in (None, "json")):
        return None
    return run_validate_many([Path(p) for p in paths], "json" if json_out else (fmt or "text"), strict)


def run_validate_many(args: list[Path], fmt: str = "text", strict: bool = False) -> int:
    """Validate each config (pre-commit passes several) with the ``KEY=VALUE`` settings among the
    arguments applied to every one; exit 1 when any is invalid. With JSON and more than one file the
    output is a list of the one-file objects."""
    from apr.config.layers import is_setting

    settings = [str(a) for a in args if is_setting(str(a))]
    configs = [Path(a) for a in args if not is_setting(str(a))]
    if not configs:
        import typer

        raise typer.BadParameter("name at least one config file", param_hint="CONFIG")
    if fmt == "json" and len(configs) > 1:

        docs, code = [], 0
        for config in configs:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = max(code, run_validate(config, fmt, settings, strict))
            docs.append(json.loads(buf.getvalue()))
        print(json.dumps(docs, indent=2))
        return code
    return max(run_validate(config, fmt, settings, strict) for config in configs)


def register(app: typer.Typer) -> None:
    import typer

    @app.command("validate")
    def validate(
        configs: list[Path] = typer.Argument(
            ..., metavar="CONFIG [KEY=VALUE]", show_default=False,
            help="Training config(s) (YAML), then settings that override keys (training.max_steps=100)."),
        json_out: bool = typer.Option(False, "--json", help="Print findings as JSON (= --format json)."),
        fmt: str | None = typer.Option(
            None, "--format", metavar="FORMAT",
            help="text (default), json, or github: GitHub Actions annotations and a step summary."),
        strict: bool = typer.Option(False, "--strict", help="Fail (exit 1) on warnings too, as plan --strict does."),
    ) -> None:
        """Check a config's schema and its config-only contracts. Exit 0 valid, 1 invalid (or warnings
        with --strict), 2 usage."""
        raise typer.Exit(run_validate_many(configs, output_format(fmt, json_out), strict))
