"""`apr monitor [RUN_DIR]`: live dashboard, `--json` for agents, discovery of active runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from apr.monitor import launch
from apr.monitor import web as web_dashboard
from apr.monitor.web import DEFAULT_MAX_SESSIONS


def register(app: typer.Typer) -> None:
    @app.command("monitor")
    def monitor(
        run_dir: Path = typer.Argument(
            None,
            help="Run directory (holds training_state.json). Default: the active runs of the registry.",
            show_default=False,
            metavar="RUN_DIR",
        ),
        json_out: bool = typer.Option(False, "--json", help="Print the state as one JSON object and exit."),
        follow: bool = typer.Option(
            False, "--follow", help="With --json: one JSON line per change until the run ends."
        ),
        timeout: float = typer.Option(
            None,
            "--timeout",
            min=0.0,
            help="Give up after this many seconds (--follow exits 1; the dashboard quits).",
            show_default=False,
        ),
        refresh: int = typer.Option(
            None,
            "--refresh",
            min=50,
            help="Refresh period in ms. Default: monitoring.terminal.refresh_rate in RUN_DIR/config.yaml, "
            "else 1000.",
            show_default=False,
        ),
        no_history: bool = typer.Option(
            False, "--no-history", help="With --json: leave out the *_history arrays."
        ),
        web: bool = typer.Option(False, "--web", help="Serve the dashboard to a browser (textual-serve)."),
        host: str = typer.Option("127.0.0.1", "--host", metavar="ADDR", help="With --web: the address to listen on."),
        port: int = typer.Option(8000, "--port", min=1, max=65535, metavar="N", help="With --web: the port."),
        max_sessions: int = typer.Option(
            DEFAULT_MAX_SESSIONS, "--max-sessions", min=1, metavar="N",
            help="With --web: at most N browser tabs at once (each runs one dashboard process).",
        ),
        no_token: bool = typer.Option(
            False, "--no-token", help="With --web: serve without the secret token in the URL (not recommended)."
        ),
        dashboard: Path | None = typer.Option(
            None, "--dashboard", metavar="FILE", show_default=False,
            help="Dashboard layout (YAML: rows of panels; docs/monitor.md), for the terminal and --web alike.",
        ),
    ) -> None:
        """Watch a training run: full-screen dashboard, or JSON for scripts and agents.

        Exit 0 ok (with --follow: the run ended), 1 no state / no active run / timeout, 2 usage.
        """

        if web and json_out:
            raise typer.BadParameter("--web serves the dashboard; --json prints JSON: give one", param_hint="--web")
        if not web and (no_token or max_sessions != DEFAULT_MAX_SESSIONS):
            raise typer.BadParameter("--no-token and --max-sessions go with --web", param_hint="--web")
        if follow and not json_out:
            raise typer.BadParameter(
                "--follow needs --json (the dashboard follows by itself)", param_hint="--follow"
            )
        if dashboard is not None and json_out:
            raise typer.BadParameter("--dashboard lays out the dashboard; --json prints JSON", param_hint="--dashboard")
        if follow and run_dir is None:
            raise typer.BadParameter("--follow needs a RUN_DIR", param_hint="--follow")
        try:
            if web:
                code = _serve_web(run_dir, host, port, refresh, timeout, max_sessions, no_token, dashboard)
            elif json_out and run_dir is None:
                typer.echo(json.dumps(launch.active_runs_document(refresh)))
                code = 0
            elif json_out and follow:
                code = launch.print_json_follow(run_dir, refresh, timeout, not no_history)
            elif json_out:
                code = launch.print_json_once(run_dir, refresh, not no_history)
            else:
                code = launch.run_dashboard(run_dir, refresh, timeout, dashboard)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        raise typer.Exit(code)


def _serve_web(run_dir: Path | None, host: str, port: int, refresh: int | None, timeout: float | None,
               max_sessions: int, no_token: bool, dashboard: Path | None = None) -> int:
    """Print the address (with its token, once) and any warning, then serve until Ctrl-C."""
    server = web_dashboard.WebDashboard(run_dir, host, port, refresh, timeout, max_sessions=max_sessions,
                                        use_token=not no_token, dashboard=dashboard)
    web_dashboard.check_port(host, port)
    for warning in server.warnings:
        bar = "!" * 78
        print(f"{bar}\nWARNING: {warning}\n{bar}", file=sys.stderr, flush=True)
    print(f"apr monitor --web: serving {server.title} at {server.url} (Ctrl-C stops; at most {max_sessions} "
          "browser sessions)", flush=True)
    return server.serve()
