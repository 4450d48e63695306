"""Where prompts come from (apr/generate/prompts.py): bounded (stdin and files past the cap are
refused without being buffered, a batch has a prompt cap), UTF-8 checked with the byte offset named."""

from __future__ import annotations

import io

import pytest

from apr.errors import AprError
from apr.generate import prompts
from apr.generate.prompts import MAX_PROMPT_BYTES, read_prompts


class CountingStdin:
    """A binary stdin that never ends (``yes | apr generate --prompt-file -``), counting what is read."""

    def __init__(self):
        self.read_bytes = 0
        self.buffer = self

    def read(self, n: int = -1) -> bytes:
        assert n > 0, "stdin must be read in chunks, never whole"
        self.read_bytes += n
        return b"y\n" * (n // 2)


def test_an_endless_stdin_is_refused_after_the_cap_not_buffered():
    stdin = CountingStdin()
    with pytest.raises(AprError) as err:
        read_prompts([], "-", stdin=stdin)
    assert "--prompt-file" in err.value.message and "16 MiB" in err.value.message
    assert stdin.read_bytes <= MAX_PROMPT_BYTES + 2 * prompts._CHUNK


def test_a_prompt_file_over_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "MAX_PROMPT_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text("a prompt\n" * 200)
    with pytest.raises(AprError) as err:
        read_prompts([], str(big))
    assert str(big) in err.value.message and "more than the 1000 bytes" in err.value.message


def test_too_many_prompts_are_refused_naming_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "MAX_PROMPTS", 3)
    f = tmp_path / "p.txt"
    f.write_text("a\nb\nc\nd\n")
    with pytest.raises(AprError, match="4 prompts: one batch takes at most 3"):
        read_prompts([], str(f))
    monkeypatch.setattr(prompts, "MAX_PROMPTS", 4)
    assert read_prompts([], str(f)) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("where", ["file", "stdin"])
def test_non_utf8_prompts_name_the_source_and_byte_offset(tmp_path, where):
    data = "héllo\nwörld ".encode() + b"\xff\xfe tail\n"
    offset = data.index(b"\xff")
    if where == "file":
        f = tmp_path / "latin.txt"
        f.write_bytes(data)
        call = lambda: read_prompts([], str(f))  # noqa: E731
        named = str(f)
    else:
        stdin = io.TextIOWrapper(io.BytesIO(data))
        call = lambda: read_prompts([], "-", stdin=stdin)  # noqa: E731
        named = "stdin"
    with pytest.raises(AprError) as err:
        call()
    message = err.value.message
    assert named in message and f"byte offset {offset}" in message and "line 2" in message and "0xff" in message
    assert err.value.findings[0].path == "--prompt-file" and err.value.findings[0].line == 2


def test_stdin_is_read_once():
    stdin = io.TextIOWrapper(io.BytesIO(b"one prompt"))
    assert read_prompts(["-"], None, stdin=stdin) == ["one prompt"]
    stdin = io.TextIOWrapper(io.BytesIO(b"x"))
    with pytest.raises(AprError, match="already read"):
        read_prompts(["-"], "-", stdin=stdin)


def test_a_fifo_or_folder_as_prompt_file_is_refused_without_blocking(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "fifo", tmp_path):
        with pytest.raises(AprError):
            read_prompts([], str(path))


def test_one_long_line_is_refused_by_size_naming_the_file_and_line_not_echoing_it(tmp_path):
    """A 15 MiB single-line prompt file (under the 16 MiB file cap) took gigabytes and half a minute
    to tokenize before the context refused it, and the error named --prompt and echoed the prompt."""
    f = tmp_path / "one-line.txt"
    secret = "SECRET-PROMPT-TEXT "
    f.write_text("short prompt\n" + secret * (15 * 2**20 // len(secret)) + "\n")
    with pytest.raises(AprError) as err:
        read_prompts([], str(f))
    e = err.value
    assert f"--prompt-file {f} line 2 is 15.0 MiB: one prompt may be at most 1 MiB" in e.message
    assert e.findings[0].path == "--prompt-file" and e.findings[0].line == 2
    assert "SECRET" not in e.message and "SECRET" not in str(e.findings[0])


def test_a_prompt_argument_that_is_not_utf8_is_refused_naming_the_byte():
    """Command-line bytes that are not UTF-8 reach Python as lone surrogates: a traceback once."""
    with pytest.raises(AprError, match=r"--prompt is not UTF-8 text: invalid byte 0xff at character 2"):
        read_prompts(["ab\udcffcd"], None)


def test_origins_name_where_each_prompt_came_from(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a\n\nb\n")
    origins: list[str] = []
    assert read_prompts(["x", "y"], str(f), origins=origins) == ["x", "y", "a", "b"]
    assert origins == ["--prompt 1", "--prompt 2", f"--prompt-file {f} line 1", f"--prompt-file {f} line 3"]
