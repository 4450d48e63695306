"""`apr monitor --web`: the same Textual dashboard, served to a browser.

Each browser tab's websocket starts one ``apr monitor RUN_DIR`` (the terminal dashboard, unchanged)
under Textual's web driver, through textual-serve's ``AppService``, and its screen is relayed to
xterm.js in the page: one UI, two ways to see it. The HTTP side is apr's own (aiohttp), because a
dashboard server on a developer's machine must not be readable by any web page the browser visits:

- every request's ``Host`` must name this server (loopback names when bound to loopback), which
  defeats DNS rebinding; a request with an ``Origin`` must come from the page this server served;
- the page and the websocket need the random token printed once at start (as Jupyter does), unless
  ``--no-token``;
- at most ``max_sessions`` websockets (each one a dashboard process) are open at once;
- the page loads nothing from the network: textual-serve's script, CSS and font are served locally.

docs/monitor.md ("In a browser") documents all of it.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import html
import importlib.util
import ipaddress
import secrets
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from apr.errors import AprError, Finding
from apr.monitor.dashboard import load_dashboard

EXTRA = "web"  # pip install 'apr[web]'
DEFAULT_MAX_SESSIONS = 4  # each session is one dashboard process (~50 MB)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def dashboard_command(run_dir: Path | None, refresh: int | None, timeout: float | None,
                      dashboard: Path | None = None) -> str:
    """The command each browser tab runs: this Python, ``-m apr monitor`` with the same options
    (the same ``--dashboard`` file: one layout for the terminal and the browser)."""
    parts = [sys.executable, "-m", "apr", "monitor"]
    if dashboard is not None:
        parts += ["--dashboard", str(Path(dashboard).resolve())]
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


# ---------------------------------------------------------------------------------------- the guard


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip  # '::ffff:127.0.0.1' (a dual-stack bind)


def _is_loopback_name(name: str) -> bool:
    ip = _ip(name)
    if ip is not None:
        return ip.is_loopback
    name = name.lower().rstrip(".")
    return name in LOOPBACK_NAMES or name.endswith(".localhost")  # RFC 6761: *.localhost is loopback


def bind_addresses(host: str) -> list[str]:
    """The addresses ``host`` (the --host value) resolves to."""
    ip = _ip(host)
    if ip is not None:
        return [str(ip)]
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror:
        return []


def is_loopback_bind(host: str) -> bool:
    """Whether serving on ``host`` is reachable only from this machine."""
    addresses = bind_addresses(host)
    return bool(addresses) and all(_ip(a) is not None and _ip(a).is_loopback for a in addresses)


def split_host_header(value: str) -> tuple[str, str | None]:
    """'127.0.0.1:8000' -> ('127.0.0.1', '8000'); '[::1]:8000' -> ('::1', '8000'); 'localhost' ->
    ('localhost', None). The name is lower-cased."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value.lower(), None
        name, rest = value[1:end], value[end + 1:]
        return name.lower(), rest[1:] if rest.startswith(":") else None
    if value.count(":") == 1:
        name, port = value.split(":")
        return name.lower(), port
    return value.lower(), None


@dataclass
class Guard:
    """Who may talk to the server: pure checks over header values, no network (tested directly).

    ``loopback``: the server listens on loopback only, so the only names a request may use are
    loopback ones. Otherwise also this machine's names, the --host value and, as an IP literal, the
    address the connection arrived on (a rebinding page uses a domain name, never that literal).
    """

    loopback: bool
    token: str | None
    max_sessions: int
    names: frozenset[str] = field(default_factory=frozenset)  # extra allowed names (lower case)
    sessions: int = 0

    @classmethod
    def for_bind(cls, host: str, token: str | None, max_sessions: int) -> Guard:
        loopback = is_loopback_bind(host)
        names = {host.lower().strip("[]")}
        if not loopback:
            hostname = socket.gethostname()
            names |= {hostname.lower(), socket.getfqdn(hostname).lower()}
        return cls(loopback, token, max_sessions, frozenset(n for n in names if n))

    def host_problem(self, host_header: str | None, local_address: str | None) -> str | None:
        """Why a request with this ``Host`` header must be refused, or None."""
        if not host_header:
            return "the request has no Host header"
        name, port = split_host_header(host_header)
        if port is not None and not port.isdigit():
            return f"Host {host_header!r} is not a host name with a port"
        if _is_loopback_name(name):
            # a loopback name reaches this machine only; a non-loopback bind takes it only when the
            # connection came in over loopback (an SSH tunnel's end), never from the network
            if self.loopback or (local_address is not None and _is_loopback_name(local_address)):
                return None
            return f"Host {name!r} is a loopback name but the request came from the network"
        if self.loopback:
            return f"Host {name!r} is not a loopback name and the server listens on loopback only"
        if name in self.names:
            return None
        ip = _ip(name)
        if ip is not None and local_address is not None and _ip(local_address) == ip:
            return None
        return f"Host {name!r} does not name this server"

    @staticmethod
    def origin_problem(origin: str | None, host_header: str | None) -> str | None:
        """Why a request with this ``Origin`` must be refused (None: no Origin, or this server's)."""
        if origin is None:
            return None  # not sent by a browser page (browsers always send it on a websocket)
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return f"Origin {origin!r} is not this server's page"
        if not host_header or parts.netloc.lower() != host_header.strip().lower():
            return f"Origin {origin!r} is another site than {host_header!r}"
        return None

    def token_ok(self, given: str | None) -> bool:
        if self.token is None:
            return True
        return given is not None and hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode())

    def try_open_session(self) -> bool:
        if self.sessions >= self.max_sessions:
            return False
        self.sessions += 1
        return True

    def close_session(self) -> None:
        self.sessions = max(0, self.sessions - 1)


# ---------------------------------------------------------------------------------------- the page

PAGE = """<!DOCTYPE html>
<html lang="en">
  <head>
    <meta charset="utf-8">
    <meta name="referrer" content="no-referrer">
    <title>{title}</title>
    <link rel="icon" href="data:,">
    <link rel="preload" href="/static/fonts/RobotoMono-VariableFont_wght.ttf" as="font" type="font/ttf"
          crossorigin>
    <link rel="stylesheet" href="/static/css/xterm.css">
    <script src="/static/js/textual.js"></script>
    <style>
      @font-face {{
        font-family: "Roboto Mono";
        src: url("/static/fonts/RobotoMono-VariableFont_wght.ttf") format("truetype");
        font-weight: 100 700; font-style: normal; font-display: block;
      }}
      @font-face {{
        font-family: "Roboto Mono";
        src: url("/static/fonts/RobotoMono-Italic-VariableFont_wght.ttf") format("truetype");
        font-weight: 100 700; font-style: italic; font-display: block;
      }}
      html, body {{ margin: 0; height: 100%; background: #0c181f; }}
      body {{ font-family: "Roboto Mono", ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }}
      .textual-terminal {{ width: 100vw; height: 100vh; opacity: 0; }}
      body.-first-byte .textual-terminal {{ opacity: 1; }}
      .dialog {{ position: absolute; inset: 0; display: flex; align-items: center; justify-content: center;
                 color: rgba(255, 255, 255, 0.95); z-index: 10; }}
      body.-first-byte .intro-dialog {{ display: none; }}
      .closed-dialog {{ display: none; background: #0c181f; }}
      body.-closed .closed-dialog {{ display: flex; }}
      .button {{ margin: 16px; padding: 8px 24px; color: #fff; background: #5e0ba7; text-decoration: none; }}
    </style>
  </head>
  <body>
    <div class="dialog intro-dialog"><div>{title}</div><span id="start"></span></div>
    <div class="dialog closed-dialog"><div>Session ended.</div><a class="button" href="">Restart</a></div>
    <div id="terminal" class="textual-terminal" data-session-websocket-url="{websocket_url}"
         data-font-size="{font_size}"></div>
  </body>
</html>
"""


def page_html(title: str, websocket_url: str, font_size: int = 16) -> str:
    """The dashboard page: textual-serve's script, CSS and font, all from this server."""
    return PAGE.format(title=html.escape(title), websocket_url=html.escape(websocket_url, quote=True),
                       font_size=int(font_size))


# ---------------------------------------------------------------------------------------- the server


class WebDashboard:
    """The server of `apr monitor --web`. Build it (checks the port and the package), show ``url``
    and ``warnings`` to the user, then ``serve()`` until Ctrl-C."""

    def __init__(self, run_dir: Path | None, host: str = "127.0.0.1", port: int = 8000,
                 refresh: int | None = None, timeout: float | None = None,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, use_token: bool = True,
                 command: str | None = None, dashboard: Path | None = None) -> None:
        if importlib.util.find_spec("textual_serve") is None:
            raise AprError(f"apr monitor --web needs the textual-serve package: pip install 'apr[{EXTRA}]'",
                           [Finding("error", "monitor.web_package", "textual-serve is not installed",
                                    expected=f"pip install 'apr[{EXTRA}]'", got="not installed")])
        if run_dir is not None and not (Path(run_dir) / "training_state.json").is_file():
            raise AprError(f"{run_dir}: no training_state.json (not a run directory, or the run has not started)",
                           [Finding("error", "monitor.no_state", "no training_state.json", file=str(run_dir))])
        if max_sessions < 1:
            raise AprError(f"--max-sessions {max_sessions}: at least 1 browser session is needed", [Finding(
                "error", "monitor.max_sessions", "the session limit must be at least 1", expected=">= 1",
                got=str(max_sessions))])
        self.run_dir, self.host, self.port = run_dir, host, port
        if dashboard is not None:
            load_dashboard(dashboard)  # checked here: a tab would otherwise fail after the server started
        self.command = command or dashboard_command(run_dir, refresh, timeout, dashboard)
        self.title = f"apr monitor {run_dir}" if run_dir is not None else "apr monitor"
        self.guard = Guard.for_bind(host, secrets.token_urlsafe(32) if use_token else None, max_sessions)

    @property
    def url(self) -> str:
        """The address to open (with the token): a wildcard bind is shown as this machine's name."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        if _ip(host) is not None and _ip(host).version == 6:
            host = f"[{host}]"
        query = f"?token={self.guard.token}" if self.guard.token else ""
        return f"http://{host}:{self.port}/{query}"

    @property
    def warnings(self) -> list[str]:
        out = []
        if not self.guard.loopback:
            out.append(f"--host {self.host} is not a loopback address: the dashboard is reachable from the "
                       "network, unencrypted (plain HTTP)" + ("" if self.guard.token else
                                                              " and, with --no-token, without any secret") +
                       ". Prefer the default 127.0.0.1 and an SSH tunnel (docs/monitor.md).")
        elif self.guard.token is None:
            out.append("--no-token: any program or user of this machine can open the dashboard")
        return out

    def app(self):
        """The aiohttp application (lazy imports: aiohttp and textual-serve are the web extra)."""
        import textual_serve
        from aiohttp import WSMsgType, web
        from textual_serve.app_service import AppService
        from textual_serve.download_manager import DownloadManager

        guard, command, title = self.guard, self.command, self.title
        downloads = DownloadManager()
        open_sockets: set = set()

        def refuse(status: int, why: str) -> web.Response:
            return web.Response(status=status, text=f"apr monitor --web: {why}\n")

        @web.middleware
        async def check_request(request: web.Request, handler):
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            local = sockname[0] if sockname else None
            host_header = request.headers.get("Host")
            why = guard.host_problem(host_header, local) or guard.origin_problem(
                request.headers.get("Origin"), host_header)
            if why:
                return refuse(403, why)
            return await handler(request)

        def token_of(request: web.Request) -> str | None:
            return request.match_info.get("token") or request.query.get("token")

        async def index(request: web.Request) -> web.Response:
            if not guard.token_ok(token_of(request)):
                return refuse(403, "a token is needed: open the address `apr monitor --web` printed "
                                   "(http://HOST:PORT/?token=...)")
            scheme = "wss" if request.secure else "ws"
            ws_path = f"/ws/{guard.token}" if guard.token else "/ws"
            font_size = request.query.get("fontsize", "16")
            response = web.Response(text=page_html(title, f"{scheme}://{request.host}{ws_path}",
                                                   int(font_size) if font_size.isdigit() else 16),
                                    content_type="text/html")
            response.headers["Cache-Control"] = "no-store"  # the page holds the token
            response.headers["Referrer-Policy"] = "no-referrer"
            response.headers["Content-Security-Policy"] = (
                "default-src 'self'; connect-src 'self' ws: wss:; style-src 'self' 'unsafe-inline'; "
                "script-src 'self'; img-src 'self' data:; font-src 'self'")
            return response

        async def websocket(request: web.Request) -> web.StreamResponse:
            if not guard.token_ok(token_of(request)):
                return refuse(403, "a token is needed (the one `apr monitor --web` printed)")
            if not guard.try_open_session():
                return refuse(503, f"{guard.max_sessions} browser sessions are open, the most this server "
                                   "allows (--max-sessions): close one")
            try:
                return await relay(request)
            finally:
                guard.close_session()

        async def relay(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(heartbeat=15)

            def size(key: str, default: int) -> int:
                value = request.query.get(key, "")
                return min(1000, max(10, int(value))) if value.isdigit() else default

            await ws.prepare(request)
            open_sockets.add(ws)
            service = AppService(command, write_bytes=ws.send_bytes, write_str=ws.send_str, close=ws.close,
                                 download_manager=downloads)
            try:
                await service.start(size("width", 80), size("height", 24))
                async for message in ws:
                    if message.type != WSMsgType.TEXT:
                        continue
                    try:
                        kind, data = message.json()
                    except (ValueError, TypeError):
                        continue  # not a [type, data] envelope: ignored
                    if kind == "stdin" and isinstance(data, str):
                        await service.send_bytes(data.encode("utf-8"))
                    elif kind == "resize" and isinstance(data, dict):
                        width, height = data.get("width"), data.get("height")
                        if isinstance(width, int) and isinstance(height, int):
                            await service.set_terminal_size(min(1000, max(10, width)), min(1000, max(10, height)))
                    elif kind == "ping":
                        await ws.send_json(["pong", data])
                    elif kind == "blur":
                        await service.blur()
                    elif kind == "focus":
                        await service.focus()
            finally:
                open_sockets.discard(ws)
                await service.stop()
                await ws.close()
                await reap(service)
            return ws

        async def reap(service) -> None:
            """Wait for the session's dashboard process (textual-serve asks it to quit but does not wait),
            so that a session's place is free only once its process is gone."""
            process = getattr(service, "_process", None)
            if process is None:
                return
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()

        async def close_sessions(_app) -> None:  # on Ctrl-C: end each dashboard now, not after a timeout
            for ws in list(open_sockets):
                await ws.close(message=b"server shutdown")

        static = Path(textual_serve.__file__).resolve().parent / "static"
        app = web.Application(middlewares=[check_request])
        app.on_shutdown.append(close_sessions)
        app.add_routes([
            web.get("/", index),
            web.get("/ws", websocket),
            web.get("/ws/{token}", websocket),
            web.static("/static", static, show_index=False),
        ])
        return app

    def serve(self) -> int:
        """Serve until SIGINT/SIGTERM (exit 0)."""
        from aiohttp import web

        check_port(self.host, self.port)
        web.run_app(self.app(), host=self.host, port=self.port, print=None, access_log=None)
        return 0

