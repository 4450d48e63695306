"""apr.readers: every file apr reads is bounded (regular files only, size caps, nesting depth)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from apr import readers
from apr.errors import AprError
from apr.readers import InputError, load_json, read_bytes, read_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code(exc: AprError) -> str:
    return exc.findings[0].code


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(InputError) as e:
        load_json(fifo, "plan", "plan file")
    assert time.monotonic() - start < 1
    f = e.value.findings[0]
    assert f.code == "file.not_regular" and "FIFO" in f.got and f.file == str(fifo)


def test_devices_and_directories_are_refused(tmp_path):
    with pytest.raises(InputError) as e:
        read_bytes("/dev/zero", "config", "config file")
    assert _code(e.value) == "file.not_regular" and "character device" in e.value.message
    with pytest.raises(InputError) as e:
        read_bytes(tmp_path, "config", "config file")
    assert _code(e.value) == "file.directory"


def test_symlink_loop_is_named_as_such_not_missing(tmp_path):
    loop = tmp_path / "a.json"
    os.symlink(tmp_path / "b.json", loop)
    os.symlink(loop, tmp_path / "b.json")
    with pytest.raises(InputError) as e:
        read_text(loop, "state", "state file")
    assert _code(e.value) == "file.symlink_loop" and "loop" in e.value.message


def test_dangling_symlink_names_its_target(tmp_path):
    link = tmp_path / "tok.json"
    os.symlink("gone.json", link)
    with pytest.raises(InputError) as e:
        read_text(link, "tokenizer", "tokenizer")
    assert _code(e.value) == "file.dangling_symlink" and "gone.json" in e.value.message


def test_size_cap_is_checked_before_reading(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: 20 GiB claimed, nothing written
        f.truncate(20 * 2**30)
    start = time.monotonic()
    with pytest.raises(InputError) as e:
        read_bytes(big, "plan", "plan file")
    assert time.monotonic() - start < 1
    f = e.value.findings[0]
    assert f.code == "file.too_large" and f.got == "20 GiB" and f.expected == "at most 16 MiB"


def test_size_cap_holds_for_files_that_lie_about_their_size():
    # /proc files report size 0 and can be read on; the cap is enforced while reading too
    with pytest.raises(InputError) as e:
        read_bytes("/proc/self/maps", "config", limit=16)
    assert _code(e.value) == "file.too_large"


def test_deep_json_is_a_clean_error_naming_where(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(InputError) as e:
        load_json(deep, "state", "state file")
    assert _code(e.value) == "file.too_deep"
    shallow_but_over = tmp_path / "over.json"
    shallow_but_over.write_text('{"a": ' + "[" * 70 + "]" * 70 + "}")
    with pytest.raises(InputError) as e:
        load_json(shallow_but_over, "state", "state file")
    assert e.value.findings[0].path.startswith("a[0][0]")


def test_invalid_json_and_utf8_name_the_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{\n "a": 1,\n}')
    with pytest.raises(InputError) as e:
        load_json(bad, "plan", "plan file")
    assert _code(e.value) == "file.json" and e.value.findings[0].line == 3
    bad.write_bytes(b'{\n"a": "\xff"}')
    with pytest.raises(InputError) as e:
        load_json(bad, "plan", "plan file")
    assert _code(e.value) == "file.encoding" and e.value.findings[0].line == 2


def test_regular_files_read_normally_and_error_class_is_the_callers(tmp_path):
    ok = tmp_path / "ok.json"
    ok.write_text('{"a": [1, {"b": 2}]}')
    assert load_json(ok, "checkpoint") == {"a": [1, {"b": 2}]}
    with pytest.raises(KeyError):
        read_bytes(ok, "no-such-kind")

    class Mine(AprError):
        pass

    with pytest.raises(Mine):
        read_bytes(tmp_path / "missing.json", "plan", error=Mine)


def test_every_kind_has_a_cap_under_the_documented_maximum():
    assert set(readers.LIMITS) >= {"config", "plan", "state", "checkpoint", "manifest", "tokenizer"}
    assert readers.LIMITS["config"] <= 2**20 and readers.LIMITS["tokenizer"] <= 64 * 2**20


def test_a_fifo_config_does_not_hang_validate(tmp_path):
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "apr", "train", "validate", str(fifo)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout + proc.stderr
    assert "FIFO" in out and "Traceback" not in out
