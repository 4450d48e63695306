"""`apr monitor --web`: the same dashboard in a browser. A websocket client (what the page's xterm.js
is) reads the screen of a live training run off the wire and sees the step advance and the loss
chart; a headless Chromium (Playwright) shows the panels and the run's numbers and keeps a
screenshot; the server refuses foreign Origins and Hosts, a missing or wrong token and sessions over
its limit, and its page loads nothing from the network; a port in use or a missing package is a
clear error."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.cli.main import app

from .test_pty import VirtualScreen

pytest.importorskip("textual_serve", reason="the web extra (textual-serve) is not installed")
aiohttp = pytest.importorskip("aiohttp", reason="aiohttp (textual-serve's dependency) is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402

ROWS, COLS = 30, 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _served_url(line: str, port: int) -> tuple[str, str]:
    """The server's base URL and token, from the line `apr monitor --web` prints."""
    m = re.search(rf"(http://127\.0\.0\.1:{port})/\?token=([\w-]+)", line)
    assert m, line
    return m.group(1), m.group(2)


async def _watch(url: str, screen: VirtualScreen, until, seconds: float, token: str = "") -> None:
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?token={token}&width={COLS}&height={ROWS}") as ws:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not until():
                try:
                    msg = await ws.receive(timeout=0.5)
                except TimeoutError:
                    continue
                if msg.type == aiohttp.WSMsgType.BINARY:
                    screen.feed(msg.data.decode("utf-8", "replace"))
                elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break


class _SteppedRun:
    """A training run that advances only when told: stopped (SIGSTOP, its whole process group) until
    the dashboard has shown the step it is at, then let go until its state file names a later step.
    The test waits for what the browser shows, never for a timing (issue 54 item 7)."""

    def __init__(self, proc: subprocess.Popen, state_file: Path):
        self.proc, self.state_file = proc, state_file
        self.stopped = False

    def step(self) -> int | None:
        import json

        try:
            return int(json.loads(self.state_file.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # not written yet

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> int | None:
        """Stop the run and return the step its state names once it is really stopped (a signal
        lands asynchronously: the run may rename one more state file into place first)."""
        self._signal(signal.SIGSTOP)
        self.stopped = True
        deadline = time.monotonic() + 30
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                break  # no /proc: the state read below may be one step early, which the test tolerates
            if fields[0] in ("T", "t"):
                break
            time.sleep(0.01)
        return self.step()

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.stopped = False

    def advance(self, after: int | None, seconds: float = 120) -> int | None:
        """Let the run go until its state names a step later than ``after`` (or it ends), then stop it
        again; the step it is stopped at."""
        self.resume()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.proc.poll() is None:
            now = self.step()
            if now is not None and (after is None or now > after):
                break
            time.sleep(0.01)
        return self.stop()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(timeout=60)


@pytest.mark.slow
def test_the_browser_dashboard_shows_a_live_run(tmp_path, _private_apr_home):
    make_dataset(tmp_path, train_rows=400)
    cfg = write_config(tmp_path, training={"epochs": 3, "max_steps": 300, "log_interval": 1, "eval_interval": 0,
                                           "save_interval": 1000})
    env = {**os.environ, "APR_HOME": str(_private_apr_home), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "train.log"
    port = _free_port()
    with open(log, "w") as out:
        run = _SteppedRun(subprocess.Popen([sys.executable, "-m", "apr", "train", "apply", str(cfg)], env=env,
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True),
                          tmp_path / "run" / "training_state.json")
    server = None
    try:
        at = run.advance(None)  # the first state written, then held there while the server starts
        assert at is not None and run.proc.poll() is None, log.read_text()
        server = subprocess.Popen([sys.executable, "-m", "apr", "monitor", str(tmp_path / "run"), "--web",
                                   "--port", str(port), "--refresh", "100"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        url, token = _served_url(server.stdout.readline(), port)
        for _ in range(100):  # the server is up when its page answers
            try:
                page = asyncio.run(_get(f"{url}/?token={token}"))
                break
            except OSError:
                time.sleep(0.1)
        assert "apr monitor" in page  # the page's title names the dashboard it serves
        screen = VirtualScreen(ROWS, COLS)
        shown: list[int] = []

        def shows_the_held_step() -> bool:
            nonlocal at
            m = re.search(r"step ([\d,]+) / 300", screen.text)
            now = int(m.group(1).replace(",", "")) if m else None
            if now is None or now < at or (shown and now <= shown[-1]):
                return False
            shown.append(now)  # the step the run is held at (or past it, when the state was read early)
            if len(shown) >= 3 or run.proc.poll() is not None:
                return True
            at = run.advance(now)  # seen: let the run take a step or more, and hold it there
            return False

        asyncio.run(_watch(url, screen, shows_the_held_step, 180, token))
        assert len(shown) >= 3 and shown == sorted(set(shown)), (shown, at, screen.text, log.read_text())
        assert "loss" in screen.text  # the loss panel and chart are on the page
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(timeout=30)
        run.end()


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as r:
            assert r.status == 200
            return await r.text()


def test_a_port_in_use_or_a_missing_package_is_an_error_naming_it(tmp_path, monkeypatch):
    from apr.errors import AprError
    from apr.monitor.web import check_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(AprError, match=f"port {port} on 127.0.0.1 is in use"):
            check_port("127.0.0.1", port)
    run = tmp_path / "run"
    run.mkdir()
    r = CliRunner().invoke(app, ["monitor", str(run), "--web", "--port", str(_free_port())])
    assert r.exit_code == 1 and "no training_state.json" in r.output
    assert CliRunner().invoke(app, ["monitor", str(run), "--web", "--json"]).exit_code == 2
    from apr.monitor import web

    monkeypatch.setattr(web.importlib.util, "find_spec", lambda name: None)
    r = CliRunner().invoke(app, ["monitor", str(run), "--web"])
    assert r.exit_code == 1 and "pip install 'apr[web]'" in r.output



# ------------------------------------------------------------------------------------------ who may connect
# The server runs in this process (aiohttp on 127.0.0.1, port 0); each browser session runs a stub
# instead of the dashboard: it says it is a Textual app, sends one screen packet and exits when the
# server tells it to quit, so these tests take milliseconds and never start Textual.

STUB = ("import sys; out = sys.stdout.buffer; "
        "out.write(b'__GANGLION__\\n' + b'D' + (5).to_bytes(4, 'big') + b'hello'); out.flush(); "
        "sys.stdin.buffer.read(1)")


def _dashboard(tmp_path, **kw):
    from apr.monitor.web import WebDashboard

    from .conftest import copy_fixture

    copy_fixture("mid_run", tmp_path / "run")
    return WebDashboard(tmp_path / "run", command=f"{sys.executable} -c \"{STUB}\"", **kw)


def _serve_here(dashboard, body):
    """Run ``body(base_url)`` against ``dashboard``'s app served on a free loopback port."""
    from aiohttp import web

    async def main():
        runner = web.AppRunner(dashboard.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await body(f"http://127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


async def _ws_status(session, url: str, **kw) -> int:
    """101 when the websocket opened (and the stub's screen bytes arrived), else the HTTP status."""
    try:
        async with session.ws_connect(url, **kw) as ws:
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.BINARY and msg.data == b"hello", msg
            return 101
    except aiohttp.WSServerHandshakeError as e:
        return e.status


def test_foreign_origins_foreign_hosts_and_missing_or_wrong_tokens_are_refused(tmp_path):
    dash = _dashboard(tmp_path)
    token = dash.guard.token
    assert token and len(token) >= 32 and dash.url.endswith(f"/?token={token}")

    async def body(base):
        host = base.removeprefix("http://")
        ws = f"{base}/ws?token={token}"
        async with aiohttp.ClientSession() as s:
            results = {
                "no token": await _ws_status(s, f"{base}/ws"),
                "wrong token": await _ws_status(s, f"{base}/ws?token={token[:-1]}x"),
                "wrong path token": await _ws_status(s, f"{base}/ws/{'x' * len(token)}"),
                "foreign origin": await _ws_status(s, ws, origin="http://evil.example"),
                "same host, other port": await _ws_status(s, ws, origin="http://127.0.0.1:1"),
                "null origin": await _ws_status(s, ws, origin="null"),
                "rebound host": await _ws_status(s, ws, headers={"Host": f"evil.example:{host.split(':')[1]}"}),
                "lan host": await _ws_status(s, ws, headers={"Host": "192.168.1.10"}),
                "ok (query token)": await _ws_status(s, ws),
                "ok (path token, the page's)": await _ws_status(s, f"{base}/ws/{token}", origin=base),
                "ok (localhost name)": await _ws_status(s, ws, headers={"Host": "localhost:9999"},
                                                        origin="http://localhost:9999"),
            }
            pages = {}
            for name, url, headers in (("no token", f"{base}/", {}), ("wrong token", f"{base}/?token=abc", {}),
                                       ("rebound host", f"{base}/?token={token}", {"Host": "evil.example"}),
                                       ("foreign origin", f"{base}/?token={token}", {"Origin": "http://evil.example"}),
                                       ("static, rebound", f"{base}/static/css/xterm.css", {"Host": "evil.example"}),
                                       ("ok", f"{base}/?token={token}", {})):
                async with s.get(url, headers=headers) as r:
                    pages[name] = (r.status, await r.text())
        return results, pages

    results, pages = _serve_here(dash, body)
    assert results == {k: (101 if k.startswith("ok") else 403) for k in results}, results
    assert {k: v[0] for k, v in pages.items()} == {k: (200 if k == "ok" else 403) for k in pages}
    assert "token is needed" in pages["no token"][1] and "evil.example" in pages["rebound host"][1]
    assert f"/ws/{token}" in pages["ok"][1]  # the page's websocket carries the token


def test_the_session_over_the_limit_is_refused_until_one_closes(tmp_path):
    dash = _dashboard(tmp_path, max_sessions=2)

    async def body(base):
        url = f"{base}/ws?token={dash.guard.token}"
        async with aiohttp.ClientSession() as s:
            first = await s.ws_connect(url)
            second = await s.ws_connect(url)
            try:
                third = await _ws_status(s, url)
            finally:
                await first.close()
            deadline = time.monotonic() + 60  # the first session's place is given back once its process ended
            while dash.guard.sessions >= 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            fourth = await _ws_status(s, url)
            await second.close()
            return third, fourth

    assert _serve_here(dash, body) == (503, 101)
    assert dash.guard.sessions == 0


def test_no_token_serves_without_one_and_says_so(tmp_path):
    dash = _dashboard(tmp_path, use_token=False)
    assert "token" not in dash.url and any("--no-token" in w for w in dash.warnings)

    async def body(base):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/") as r:
                page = r.status
            return page, await _ws_status(s, f"{base}/ws"), await _ws_status(s, f"{base}/ws", origin="http://x.example")

    assert _serve_here(dash, body) == (200, 101, 403)  # the Origin and Host checks still apply


def _external_references(text: str, base: str) -> list[str]:
    """Absolute (http://, https://) and protocol-relative (//host) references to any host but ``base``'s."""
    own = base.split("://", 1)[1].lower()
    refs = re.findall(r"""(?:https?:)?//[^/\s"'<>()]+""", text, flags=re.IGNORECASE)
    return [r for r in refs if r.split("//", 1)[1].lower() != own]


def test_the_page_loads_nothing_from_another_host(tmp_path):
    dash = _dashboard(tmp_path)

    async def body(base):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/?token={dash.guard.token}") as r:
                page, csp = await r.text(), r.headers.get("Content-Security-Policy", "")
            loaded = {}
            for ref in re.findall(r'(?:href|src)="([^"]+)"', page):
                if ref.startswith("/"):
                    async with s.get(base + ref) as r:
                        loaded[ref] = (r.status, await r.read())
            return base, page, csp, loaded

    base, page, csp, loaded = _serve_here(dash, body)
    assert _external_references(page, base) == [], page
    assert "default-src 'self'" in csp and "font-src 'self'" in csp  # a browser would refuse any other host
    assert "googleapis" not in page and "@font-face" in page  # the font is served from here
    assert loaded and all(status == 200 for status, _ in loaded.values()), {k: v[0] for k, v in loaded.items()}
    assert any(ref.endswith(".ttf") for ref in loaded) and any(ref.endswith(".css") for ref in loaded)
    for ref, (_, data) in loaded.items():
        if ref.endswith(".css"):  # a stylesheet's url(...) and @import would load too (comments do not)
            css = re.sub(r"/\*.*?\*/", "", data.decode("utf-8", "replace"), flags=re.DOTALL)
            assert _external_references(css, base) == [], ref


@pytest.mark.parametrize("host_header, local, bind, refused", [
    ("127.0.0.1:8000", "127.0.0.1", "127.0.0.1", False),
    ("[::1]:8000", "::1", "127.0.0.1", False),
    ("localhost", "127.0.0.1", "127.0.0.1", False),
    ("app.localhost:8000", "127.0.0.1", "127.0.0.1", False),
    ("127.0.0.1.nip.io:8000", "127.0.0.1", "127.0.0.1", True),  # resolves to loopback, is a foreign name
    ("evil.example:8000", "127.0.0.1", "127.0.0.1", True),
    ("", "127.0.0.1", "127.0.0.1", True),
    ("127.0.0.1:80:80", "127.0.0.1", "127.0.0.1", True),
    ("evil.example:8000", "10.1.2.3", "0.0.0.0", True),  # a wildcard bind: only this machine's names
    ("10.1.2.3:8000", "10.1.2.3", "0.0.0.0", False),  # the address the connection came in on
    ("10.9.9.9:8000", "10.1.2.3", "0.0.0.0", True),
    ("localhost:8000", "10.1.2.3", "0.0.0.0", True),  # a loopback name from the network: rebinding
    ("localhost:8000", "::ffff:127.0.0.1", "::", False),  # over loopback (an SSH tunnel) on a dual-stack bind
])
def test_the_host_header_must_name_this_server(host_header, local, bind, refused):
    from apr.monitor.web import Guard

    guard = Guard.for_bind(bind, "t", 1)
    assert (guard.host_problem(host_header, local) is not None) == refused


def test_a_non_loopback_bind_warns_loudly_and_prints_the_token_once(tmp_path, monkeypatch):
    from apr.monitor import web

    from .conftest import copy_fixture

    copy_fixture("mid_run", tmp_path / "run")
    monkeypatch.setattr(web, "check_port", lambda host, port: None)  # no bind on 0.0.0.0 in a test
    monkeypatch.setattr(web.WebDashboard, "serve", lambda self: 0)
    r = CliRunner().invoke(app, ["monitor", str(tmp_path / "run"), "--web", "--host", "0.0.0.0", "--port", "8765"])
    assert r.exit_code == 0, r.output
    assert "WARNING: --host 0.0.0.0 is not a loopback address" in r.output and "SSH tunnel" in r.output
    assert len(re.findall(r"\?token=[\w-]{40,}", r.output)) == 1
    r = CliRunner().invoke(app, ["monitor", str(tmp_path / "run"), "--web", "--port", "8765"])
    assert r.exit_code == 0 and "WARNING" not in r.output and "http://127.0.0.1:8765/?token=" in r.output
    r = CliRunner().invoke(app, ["monitor", str(tmp_path / "run"), "--web", "--max-sessions", "0"])
    assert r.exit_code == 2 and "--max-sessions" in r.output
    r = CliRunner().invoke(app, ["monitor", str(tmp_path / "run"), "--no-token"])
    assert r.exit_code == 2 and "--web" in r.output


# ------------------------------------------------------------------------------------------ in a real browser

ARTIFACTS = Path(os.environ.get("APR_TEST_ARTIFACTS") or Path(__file__).resolve().parents[2] / "test-artifacts")


def _chromium() -> str | None:
    import shutil

    return (os.environ.get("APR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
            or shutil.which("google-chrome"))


def _write_state(run: Path, **changes) -> dict:
    """Rewrite the run's state file the way the trainer does (a complete file, renamed into place)."""
    import json

    path = run / "training_state.json"
    state = {**json.loads(path.read_text()), **changes}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return state


@pytest.mark.slow
@pytest.mark.browser
def test_a_headless_browser_shows_the_dashboard_of_the_run(tmp_path, _private_apr_home):
    """What a person sees in Chromium: the panels, the run's step and loss (and their update when the
    run writes a new state), nothing loaded from another host; the screenshots are kept in
    test-artifacts/monitor/ (APR_TEST_ARTIFACTS overrides)."""
    exe = _chromium()
    reason = None
    if exe is None:
        reason = "no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)"
    elif importlib.util.find_spec("playwright") is None:
        reason = "the playwright package is not installed (pip install -e '.[dev]')"
    if reason:
        if os.environ.get("APR_REQUIRE_BROWSER"):  # CI sets it: the browser test must run there
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    from .conftest import copy_fixture

    run = tmp_path / "run"
    copy_fixture("mid_run", run)
    state = _write_state(run, heartbeat=time.time())  # a live run: RUNNING, not STALE
    port = _free_port()
    env = {**os.environ, "APR_HOME": str(_private_apr_home), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "apr", "monitor", str(run), "--web", "--port", str(port),
                               "--refresh", "100"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    out = ARTIFACTS / "monitor"
    out.mkdir(parents=True, exist_ok=True)
    try:
        url, token = _served_url(server.stdout.readline(), port)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            requested: list[str] = []
            page.on("request", lambda request: requested.append(request.url))
            screen = {"now": VirtualScreen(ROWS, COLS)}

            def on_socket(ws):
                m = re.search(r"width=(\d+)&height=(\d+)", ws.url)
                screen["now"] = VirtualScreen(int(m.group(2)), int(m.group(1)))

                def sent(payload):
                    if isinstance(payload, str) and payload.startswith('["resize"'):
                        size = __import__("json").loads(payload)[1]  # Textual redraws all at a new size
                        screen["now"] = VirtualScreen(size["height"], size["width"])

                ws.on("framesent", sent)
                ws.on("framereceived", lambda payload: screen["now"].feed(
                    payload.decode("utf-8", "replace") if isinstance(payload, bytes) else ""))

            page.on("websocket", on_socket)

            def shows(*texts: str, seconds: float = 60) -> str:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    if all(t in screen["now"].text for t in texts):
                        return screen["now"].text
                    page.wait_for_timeout(100)
                raise AssertionError(f"the page never showed {texts}:\n{screen['now'].text}")

            for _ in range(100):  # the server is up when its page answers
                try:
                    page.goto(f"{url}/?token={token}")
                    break
                except Exception:  # noqa: BLE001 - connection refused while the server starts
                    time.sleep(0.1)
            page.wait_for_selector("body.-first-byte", timeout=60_000)
            text = shows("Loss (EMA", "Run", "Learning rate", "Grad norm", "Alerts", "GPU",
                         f"step {state['step']:,} / {state['total_steps']:,}", f"{state['loss']:.4f}",
                         "RUNNING")
            page.screenshot(path=str(out / "web-dashboard.png"))
            (out / "web-dashboard.txt").write_text(text)
            state = _write_state(run, step=state["step"] + 53, loss=1.6543, heartbeat=time.time())
            text = shows(f"step {state['step']:,} / {state['total_steps']:,}", "1.6543")
            page.screenshot(path=str(out / "web-dashboard-updated.png"))
            browser.close()
        foreign = [u for u in requested if not u.startswith(url + "/")]
        assert foreign == [], foreign  # fonts, scripts, styles: all from this server
        shot = (out / "web-dashboard.png").read_bytes()
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000, out  # a drawn dashboard, not a blank page
        print(f"screenshots: {out}")
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=20)
