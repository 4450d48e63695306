"""Issue 54 item 1: no reader echoes a file it was pointed at. Every input a command reads (a config,
a base config it extends, a sweep file, a sweep's base config given by --config or by its
``config:`` key, a dashboard file, a task file, calibration rows) is handed files of secrets: a
shadow-format line, key=value secrets, non-YAML junk, a mapping of secret values, a duplicate key,
a shadow line read as a key, a JSON object. Each command must refuse the file (exit 1, no
traceback) without any of the secret reaching stdout, stderr, --json output or the stores
(``$APR_HOME``, the sweep's folder). apr/quoting.py holds the rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.cli.main import app

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402

MID_RUN = Path(__file__).resolve().parent.parent / "monitor" / "fixtures" / "mid_run"
runner = CliRunner()

# name -> (file text, the secrets in it: none may be printed or stored)
SECRET_FILES = {
    "shadow": ("root:$6$SECRETHASHa1$Zx9q/w.e:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
               ["SECRETHASHa1", "Zx9q/w.e"]),
    "env": ("AWS_SECRET_ACCESS_KEY=SECRETKEYb2\nDB_URL=postgres://u:SECRETPWb3@db/x\n",
            ["SECRETKEYb2", "SECRETPWb3"]),
    "junk": ("%%%% SECRETJUNKc4 {{{ ]]\n\t:: SECRETJUNKc5 '\n", ["SECRETJUNKc4", "SECRETJUNKc5"]),
    "mapping": ("api_token: SECRETTOKd6\npassword: SECRETPWd7\n", ["SECRETTOKd6", "SECRETPWd7"]),
    "duplicate": ("password: SECRETPWe8\npassword: SECRETPWe9\n", ["SECRETPWe8", "SECRETPWe9"]),
    "shadow_key": ("root:$6$SECRETHASHf1:19000:0: x\n", ["SECRETHASHf1"]),
    "json": ('{"password": "SECRETJSONg1", "rows": 1}\n', ["SECRETJSONg1"]),
    "private_key": ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmSECRETKEYj1\n"
                    "-----END OPENSSH PRIVATE KEY-----\n", ["SECRETKEYj1", "b3BlbnNzaC1"]),
    "ini": ("[default]\naws_access_key_id = AKIASECRETk1\naws_secret_access_key = SECRETk2/x+y\n",
            ["AKIASECRETk1", "SECRETk2"]),
    "netrc": ("machine github.com login me password SECRETNETRCl1\n", ["SECRETNETRCl1"]),
}


def _secret(tmp_path: Path, kind: str, name: str = "secret.yaml") -> tuple[Path, list[str]]:
    text, secrets = SECRET_FILES[kind]
    path = tmp_path / name
    path.write_text(text)
    return path, secrets


def _stored(roots: list[Path], skip: set[Path]) -> bytes:
    """Every byte apr could have stored under ``roots`` (the secret files themselves left out)."""
    out = b""
    for root in roots:
        for p in ([root] if root.is_file() else root.rglob("*") if root.exists() else []):
            if p.is_file() and not p.is_symlink() and p.resolve() not in skip:
                out += p.read_bytes()
    return out


def _invoke(args: list[str]) -> str:
    result = runner.invoke(app, args)
    crash = result.exception if not isinstance(result.exception, SystemExit) else None
    assert crash is None, f"apr {' '.join(args)} raised {type(crash).__name__}\n{result.output}"
    assert result.exit_code == 1, f"apr {' '.join(args)} exited {result.exit_code}\n{result.output}"
    out = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "Traceback" not in out, out
    return out


def _assert_hidden(texts: list[str], stores: bytes, secrets: list[str]) -> None:
    for secret in secrets:
        for text in texts:
            assert secret not in text, f"{secret!r} printed:\n{text}"
        assert secret.encode() not in stores, f"{secret!r} stored"


def _sweep(tmp_path: Path, config_line: str = "") -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"method: grid\n{config_line}parameters:\n  optimizer.lr:\n    values: [0.001, 0.002]\n")
    return path


# Each reader: (the commands that read the file, given the secret file's path and a work folder).
def _config(tmp, secret):
    return [["train", "validate", str(secret)], ["train", "validate", "--json", str(secret)],
            ["train", "plan", str(secret)], ["train", "plan", "--json", str(secret)]]


def _base_config(tmp, secret):
    top = tmp / "top.yaml"
    top.write_text(f"extends: {secret.name}\ntraining:\n  max_steps: 4\n")
    return [["train", "validate", str(top)], ["train", "validate", "--json", str(top)], ["train", "plan", str(top)]]


def _sweep_file(tmp, secret):
    return [["sweep", "plan", str(secret)], ["sweep", "plan", "--json", str(secret)],
            ["sweep", "run", str(secret), "--dir", str(tmp / "sweep-dir")]]


def _sweep_config_option(tmp, secret):
    sweep = _sweep(tmp)
    return [["sweep", "plan", str(sweep), "--config", str(secret)],
            ["sweep", "plan", "--json", str(sweep), "--config", str(secret)],
            ["sweep", "run", str(sweep), "--config", str(secret), "--dir", str(tmp / "sweep-dir")]]


def _sweep_config_key(tmp, secret):
    sweep = _sweep(tmp, f"config: {secret}\n")
    return [["sweep", "plan", str(sweep)], ["sweep", "run", str(sweep), "--dir", str(tmp / "sweep-dir")]]


def _dashboard(tmp, secret):
    return [["monitor", str(MID_RUN), "--dashboard", str(secret)],
            ["monitor", str(MID_RUN), "--web", "--dashboard", str(secret)]]  # refused before the server starts


READERS = {"config": _config, "base config": _base_config, "sweep file": _sweep_file,
           "sweep --config": _sweep_config_option, "sweep config key": _sweep_config_key, "dashboard": _dashboard}


@pytest.mark.parametrize("kind", sorted(SECRET_FILES))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_no_reader_prints_or_stores_a_file_it_refuses(tmp_path, kind, reader):
    import os

    secret, secrets = _secret(tmp_path, kind)
    texts = [_invoke(args) for args in READERS[reader](tmp_path, secret)]
    for text in texts:
        assert str(secret) in "".join(text.split()) or secret.name in text, text  # the file is named
    stores = _stored([tmp_path, Path(os.environ["APR_HOME"])], {secret.resolve()})
    _assert_hidden(texts, stores, secrets)


@pytest.mark.parametrize("kind", sorted(SECRET_FILES))
def test_a_task_file_of_secrets_is_refused_without_its_lines(tmp_path, kind):
    from apr.errors import AprError
    from apr.evaluate.tasks import read_task

    secret, secrets = _secret(tmp_path, kind, "task.jsonl")
    for on_error in ("stop", "skip"):
        with pytest.raises(AprError) as caught:
            read_task(secret, on_error=on_error)
        err = caught.value
        texts = [err.message, json.dumps([f.to_dict() for f in err.findings])]
        _assert_hidden(texts, b"", secrets)


def test_a_value_too_long_to_quote_is_described_not_printed(tmp_path):
    """A config of the expected kind may have its short values quoted; a long one is described."""
    long = "x" * 30 + "SECRETLONGh1" + "y" * 30
    path = tmp_path / "cfg.yaml"
    path.write_text(f"model: {long}\ndata: {{}}\n")
    text = _invoke(["train", "validate", "--json", str(path)])
    assert "SECRETLONGh1" not in text
    assert "a string of 72 characters (not shown)" in text
    short = tmp_path / "short.yaml"
    short.write_text("model: tiny\ndata: {}\n")
    assert "'tiny'" in _invoke(["train", "validate", str(short)])  # a short value of a config is still quoted


def test_a_config_of_the_right_kind_still_names_its_unknown_keys(tmp_path):
    """The rule hides files of the wrong kind, not the did-you-mean of a real config."""
    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text() + "trainig:\n  max_steps: 3\n")
    text = _invoke(["train", "validate", str(cfg)])
    assert "unknown key 'trainig'" in text and "did you mean 'training'" in text


def test_damaged_calibration_rows_are_not_echoed(tmp_path):
    """A calibration row holding a secret where a number belongs is skipped, and the warning that
    says so describes the value, never prints it."""
    from apr.track import calibration

    secret = "SECRETCALIBi1" * 10
    row = {"time": secret, "device": "cpu", "device_name": "cpu", "apr": "0", "shape_key": "k", "shape": "{}",
           "result": "{}"}
    reason = calibration._malformed(row)
    assert reason is not None and "SECRETCALIBi1" not in reason
    assert "not shown" in reason
