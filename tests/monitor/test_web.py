"""`apr monitor --web`: textual-serve serves the same dashboard; a websocket client (what the page's
xterm.js is) reads the screen of a live training run off the wire and sees the step advance and the
loss chart; a port in use or a missing package is a clear error."""

from __future__ import annotations

import asyncio
import os
import re
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


async def _watch(url: str, screen: VirtualScreen, until, seconds: float) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?width={COLS}&height={ROWS}") as ws:
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


@pytest.mark.slow
def test_the_browser_dashboard_shows_a_live_run(tmp_path, _private_apr_home):
    make_dataset(tmp_path, train_rows=400)
    cfg = write_config(tmp_path, training={"epochs": 3, "max_steps": 300, "log_interval": 1, "eval_interval": 0,
                                           "save_interval": 1000})
    env = {**os.environ, "APR_HOME": str(_private_apr_home), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "train.log"
    port = _free_port()
    with open(log, "w") as out:
        trainer = subprocess.Popen([sys.executable, "-m", "apr", "train", "apply", str(cfg)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    server = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "training_state.json").exists():
            assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        server = subprocess.Popen([sys.executable, "-m", "apr", "monitor", str(tmp_path / "run"), "--web",
                                   "--port", str(port), "--refresh", "100"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        assert f"http://127.0.0.1:{port}" in server.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):  # the server is up when its page answers
            try:
                page = asyncio.run(_get(url))
                break
            except OSError:
                time.sleep(0.1)
        assert "apr monitor" in page  # the page's title names the dashboard it serves
        screen = VirtualScreen(ROWS, COLS)
        steps: list[int] = []

        def advanced() -> bool:
            m = re.search(r"step ([\d,]+) / 300", screen.text)
            if m and (not steps or int(m.group(1).replace(",", "")) != steps[-1]):
                steps.append(int(m.group(1).replace(",", "")))
            return len(set(steps)) >= 3

        asyncio.run(_watch(url, screen, advanced, 90))
        assert len(set(steps)) >= 3 and steps == sorted(steps), (steps, screen.text)
        assert "loss" in screen.text  # the loss panel and chart are on the page
    finally:
        for p in (server, trainer):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


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


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


async def _cdp_screenshots(browser_ws: str, url: str, shots: list[Path], gap: float) -> bool:
    """Open ``url`` in a new tab through the DevTools protocol, wait for the dashboard's first bytes,
    then save ``shots`` ``gap`` seconds apart. Returns whether the terminal received data."""
    import base64
    import json as _json

    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(browser_ws, max_msg_size=0) as ws:
            ids = iter(range(1, 10_000))

            async def call(method, session_id=None, **params):
                i = next(ids)
                msg = {"id": i, "method": method, "params": params}
                if session_id:
                    msg["sessionId"] = session_id
                await ws.send_str(_json.dumps(msg))
                while True:
                    reply = _json.loads((await ws.receive(timeout=30)).data)
                    if reply.get("id") == i:
                        return reply.get("result", {})

            target = (await call("Target.createTarget", url=url))["targetId"]
            sid = (await call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
            await call("Emulation.setDeviceMetricsOverride", sid, width=1200, height=800, deviceScaleFactor=1,
                       mobile=False)
            started = False
            for _ in range(150):
                r = await call("Runtime.evaluate", sid, expression="document.body.classList.contains('-first-byte')")
                if r.get("result", {}).get("value"):
                    started = True
                    break
                await asyncio.sleep(0.2)
            for k, shot in enumerate(shots):
                await asyncio.sleep(gap if k else 1.0)
                data = (await call("Page.captureScreenshot", sid, format="png"))["data"]
                shot.write_bytes(base64.b64decode(data))
            return started


@pytest.mark.slow
@pytest.mark.browser
def test_a_headless_browser_renders_the_live_dashboard(tmp_path, _private_apr_home):
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium): the browser test cannot run")
    make_dataset(tmp_path, train_rows=400)
    cfg = write_config(tmp_path, training={"epochs": 100, "max_steps": 10_000, "log_interval": 1,
                                           "eval_interval": 0, "save_interval": 100_000})  # outlives the test
    env = {**os.environ, "APR_HOME": str(_private_apr_home), "OMP_NUM_THREADS": "1"}
    port, debug_port = _free_port(), _free_port()
    with open(tmp_path / "train.log", "w") as out:
        trainer = subprocess.Popen([sys.executable, "-m", "apr", "train", "apply", str(cfg)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    procs = [trainer]
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "training_state.json").exists():
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        server = subprocess.Popen([sys.executable, "-m", "apr", "monitor", str(tmp_path / "run"), "--web",
                                   "--port", str(port), "--refresh", "100"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        procs.append(server)
        server.stdout.readline()
        browser = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                    f"--remote-debugging-port={debug_port}", f"--user-data-dir={tmp_path / 'chrome'}",
                                    "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(browser)
        browser_ws = None
        for line in browser.stderr:  # "DevTools listening on ws://..."
            if "DevTools listening on" in line:
                browser_ws = line.split("on", 1)[1].strip()
                break
        assert browser_ws, "chromium did not start its DevTools endpoint"
        shots = [tmp_path / "dashboard-1.png", tmp_path / "dashboard-2.png"]  # kept as the test's artifacts
        started = asyncio.run(_cdp_screenshots(browser_ws, f"http://127.0.0.1:{port}", shots, 2.0))
        assert started, "the page never received the dashboard's first bytes"
        first, second = (s.read_bytes() for s in shots)
        assert first[:8] == b"\x89PNG\r\n\x1a\n" and len(first) > 20_000  # a rendered dashboard, not the splash
        assert first != second  # the live run moved on between the two screenshots
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
