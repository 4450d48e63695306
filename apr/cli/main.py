"""Entry point: builds the typer app from the command modules and turns AprError into exit 1."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from apr import __version__
from apr.cli import (
    cmd_cache,
    cmd_calibration,
    cmd_data,
    cmd_eval,
    cmd_experiment,
    cmd_export,
    cmd_generate,
    cmd_inspect,
    cmd_monitor,
    cmd_profile,
    cmd_runs,
    cmd_schema,
    cmd_sweep,
    cmd_train_apply,
    cmd_train_fork,
    cmd_train_lrfind,
    cmd_train_plan,
    cmd_train_steer,
    cmd_train_text,
    cmd_train_validate,
    cmd_verify,
)
from apr.cli.help import tidy_help
from apr.cli.render import print_error
from apr.errors import AprError

_DEBUG = {"on": False}


class AprGroup(TyperGroup):
    """The root command group: the one place an AprError raised by any command is shown
    (``error: ...`` and its findings on stderr) and turned into its exit code; --debug re-raises.
    Its help, and every subcommand's, uses readable metavars (apr.cli.help)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tidy_help(self)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except AprError as err:
            if _DEBUG["on"]:
                raise
            print_error(err)
            ctx.exit(err.exit_code)


app = typer.Typer(
    cls=AprGroup,
    name="apr",
    help="Plan, apply and record language-model training from one YAML file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
train_app = typer.Typer(help="Validate, plan and run training configs.", no_args_is_help=True)
data_app = typer.Typer(help="Make tokenizers and pretokenized Parquet shards.", no_args_is_help=True)
runs_app = typer.Typer(help="List and inspect recorded runs.", no_args_is_help=True)
experiment_app = typer.Typer(help="Compare and export runs from an experiment store.", no_args_is_help=True)
calibration_app = typer.Typer(help="Probe results kept by `apr train plan --probe`.", no_args_is_help=True)
cache_app = typer.Typer(help="The token, teacher-output and compile caches under $APR_HOME/cache.",
                        no_args_is_help=True)
sweep_app = typer.Typer(help="Hyperparameter sweeps over a config, planned before they train (Optuna).",
                        no_args_is_help=True)
app.add_typer(train_app, name="train")
app.add_typer(data_app, name="data")
app.add_typer(runs_app, name="runs")
app.add_typer(experiment_app, name="experiment")
app.add_typer(calibration_app, name="calibration")
app.add_typer(cache_app, name="cache")
app.add_typer(sweep_app, name="sweep")

def _print_version(value: bool) -> None:
    if value:

        typer.echo(f"apr {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show a traceback on errors."),
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    _DEBUG["on"] = debug


cmd_train_validate.register(train_app)
cmd_train_plan.register(train_app)
cmd_train_apply.register(train_app)
cmd_train_fork.register(train_app)
cmd_train_steer.register(train_app)
cmd_train_lrfind.register(train_app)
cmd_train_text.register(train_app)
cmd_data.register(data_app)
cmd_runs.register(runs_app)
cmd_experiment.register(experiment_app)
cmd_calibration.register(calibration_app)
cmd_cache.register(cache_app)
cmd_sweep.register(sweep_app)
cmd_monitor.register(app)
cmd_export.register(app)
cmd_generate.register(app)
cmd_profile.register(app)
cmd_inspect.register(app)
cmd_eval.register(app)
cmd_schema.register(app)
cmd_verify.register(app)


def run() -> None:
    """Console-script entry point."""
    _DEBUG["on"] = "--debug" in sys.argv[1:]
    app(standalone_mode=True)
