"""`apr monitor --web`: the same Textual dashboard, served to a browser by textual-serve.

textual-serve runs ``apr monitor RUN_DIR`` (the terminal dashboard, unchanged) once per browser
tab, under Textual's web driver, and relays its screen over a websocket to xterm.js in the page:
one UI, two ways to see it. The server binds 127.0.0.1 by default; docs/monitor.md shows how to
reach it over an SSH tunnel.
"""

from __future__ import annotations

import errno
import importlib.util
import shlex
import socket
import sys
from pathlib import Path

from apr.errors import AprError, Finding

EXTRA = "web"  # pip install 'apr[web]'


def dashboard_command(run_dir: Path | None, refresh: int | None, timeout: float | None) -> str:
    """The command each browser tab runs: this Python, ``-m apr monitor`` with the same options."""
    parts = [sys.executable, "-m", "apr", "monitor"]
    if run_dir is not None:
        parts.append(str(Path(run_dir).resolve()))
    if refresh is not None:
        parts += ["--refresh", str(refresh)]
    if timeout is not None:
        parts += ["--timeout", str(timeout)]
    return shlex.join(parts)


def check_port(host: str, port: int) -> None:
    """Refuse, before serving, a port that is taken or a host that cannot be bound (exit 1)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise AprError(f"--host {host}: {e.strerror}", [Finding(
            "error", "monitor.host", f"cannot resolve {host!r}", expected="an address of this machine, e.g. "
            "127.0.0.1", got=host)]) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise AprError(f"port {port} on {host} {why}: choose another with --port", [Finding(
                "error", "monitor.port", f"port {port} on {host} {why}", expected="a free port, e.g. --port 8765",
                got=str(port))]) from None


def serve(run_dir: Path | None, host: str, port: int, refresh: int | None, timeout: float | None) -> int:
    if importlib.util.find_spec("textual_serve") is None:
        raise AprError(f"apr monitor --web needs the textual-serve package: pip install 'apr[{EXTRA}]'",
                       [Finding("error", "monitor.web_package", "textual-serve is not installed",
                                expected=f"pip install 'apr[{EXTRA}]'", got="not installed")])
    if run_dir is not None and not (Path(run_dir) / "training_state.json").is_file():
        raise AprError(f"{run_dir}: no training_state.json (not a run directory, or the run has not started)",
                       [Finding("error", "monitor.no_state", "no training_state.json", file=str(run_dir))])
    check_port(host, port)
    from textual_serve.server import Server  # lazy: textual-serve is an optional extra

    title = f"apr monitor {run_dir}" if run_dir is not None else "apr monitor"
    print(f"apr monitor --web: serving {title} at http://{host}:{port} (Ctrl-C stops)", flush=True)
    Server(dashboard_command(run_dir, refresh, timeout), host=host, port=port, title=title).serve()
    return 0
