"""Task files: the JSONL format, malformed lines reported by file and line, skip or stop."""

from __future__ import annotations

import json

import pytest

from apr.errors import AprError
from apr.evaluate.tasks import read_task

GOOD = {"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0}


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_a_valid_file_reads_every_example(tmp_path):
    f = write(tmp_path / "arith.jsonl", [GOOD, "", {**GOOD, "gold": 1, "id": 7, "extra": "ignored"}])
    task = read_task(f)
    assert task.name == "arith" and len(task.examples) == 2 and task.skipped == []
    assert task.examples[1].gold == 1 and task.examples[1].id == "7"
    assert task.examples[0].choices == (" 2", " 3")
    assert len(read_task(f, limit=1).examples) == 1


@pytest.mark.parametrize("bad, key, words", [
    ("{not json", "", "not valid JSON"),
    ([1, 2], "", "not a JSON object"),
    ({"context": "x", "choices": ["a", "b"]}, "gold", "missing key 'gold'"),
    ({**GOOD, "context": ""}, "context", "non-empty string"),
    ({**GOOD, "choices": ["only one"]}, "choices", "at least two"),
    ({**GOOD, "choices": ["a", 3]}, "choices", "at least two non-empty strings"),
    ({**GOOD, "gold": 2}, "gold", "index into choices"),
    ({**GOOD, "gold": True}, "gold", "index into choices"),
])
def test_a_malformed_line_stops_with_its_file_and_line(tmp_path, bad, key, words):
    f = write(tmp_path / "t.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(AprError, match=words) as err:
        read_task(f)
    finding = err.value.findings[0]
    assert (finding.file, finding.line, finding.path) == (str(f), 3, key)
    assert f"{f}:3" in err.value.message and "--on-error skip" in err.value.message


def test_skip_records_malformed_lines_and_goes_on(tmp_path):
    f = write(tmp_path / "t.jsonl", [GOOD, "{oops", {**GOOD, "gold": 9}, GOOD])
    task = read_task(f, on_error="skip")
    assert len(task.examples) == 2
    assert [(s.line, s.severity) for s in task.skipped] == [(2, "warning"), (3, "warning")]


def test_a_file_with_no_valid_example_is_an_error(tmp_path):
    f = write(tmp_path / "t.jsonl", ["{oops"])
    with pytest.raises(AprError, match="holds no example"):
        read_task(f, on_error="skip")
    with pytest.raises(AprError, match="not found"):
        read_task(tmp_path / "missing.jsonl")
    (tmp_path / "bytes.jsonl").write_bytes(b'{"context": "\xff"}\n')
    with pytest.raises(AprError, match="not UTF-8") as err:
        read_task(tmp_path / "bytes.jsonl")
    assert err.value.findings[0].line == 1


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(AprError, match="FIFO"):
        read_task(fifo)
