"""Console-script entry point. Kept free of typer so `apr train validate` and `apr runs ls` start fast."""

from __future__ import annotations

import importlib
import os
import sys
import types

from apr.cli.cmd_train_validate import fast_path

_PLUGINS_OFF = ("__all__", "1", "true")  # the values pydantic reads as "no plugins"
_PLUGIN_LOADER = "pydantic.plugin._loader"


def run() -> None:
    # We use no pydantic plugins; skipping their entry-point scan saves ~40 ms per start.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    skip_plugin_loader()

    try:
        code = fast_path(sys.argv[1:])
        if code is None:  # `apr runs ls [--global] [--json]`, which agents poll, also skips typer
            from apr.cli.cmd_runs import fast_path as runs_fast_path  # lazy: keeps `runs` off validate's path

            code = runs_fast_path(sys.argv[1:])
        if code is not None:
            sys.stdout.flush()  # here, so a reader that is gone is met inside the try
    except BrokenPipeError:
        reader_gone()
    if code is not None:
        sys.exit(code)
    from apr.cli.main import run as run_full

    run_full()


def skip_plugin_loader() -> None:
    """Stand in for pydantic's plugin loader while plugins are off. The real module imports
    ``importlib.metadata`` (and through it ``email``, ``zipfile``, ``socket``: ~5% of `apr train
    validate`) only to return no plugins when ``PYDANTIC_DISABLE_PLUGINS`` says so. The stand-in
    returns none while the variable says so and hands over to the real loader otherwise."""
    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") not in _PLUGINS_OFF or _PLUGIN_LOADER in sys.modules:
        return

    def get_plugins():
        if os.environ.get("PYDANTIC_DISABLE_PLUGINS") in _PLUGINS_OFF:
            return ()
        if sys.modules.get(_PLUGIN_LOADER) is stand_in:
            del sys.modules[_PLUGIN_LOADER]
        return importlib.import_module(_PLUGIN_LOADER).get_plugins()

    stand_in = types.ModuleType(_PLUGIN_LOADER, "apr's stand-in while PYDANTIC_DISABLE_PLUGINS is set")
    stand_in.get_plugins = get_plugins
    sys.modules[_PLUGIN_LOADER] = stand_in


def reader_gone() -> None:
    """`apr runs ls | head -1`: the reader took what it wanted and left. Exit quietly, as typer's
    commands do (click's exit 1 on EPIPE), with stdout pointed at /dev/null so that Python's own
    flush at exit does not print a BrokenPipeError either."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass
    sys.exit(1)
