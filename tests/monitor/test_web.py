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
