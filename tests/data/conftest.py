"""Small generated corpora and a tokenizer trained on them, shared by the data tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

WORDS = ("the loader reads shards of tokens and every rank takes a disjoint slice while the "
         "trainer resumes exactly from a saved cursor; def main(): return 42 # comment").split()


def make_docs(n: int, seed: int = 0, words: int = 120) -> list[str]:
    """``n`` deterministic ASCII documents of ``words`` words with newlines and indentation."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines, line = [], []
        for _ in range(words):
            line.append(rng.choice(WORDS))
            if rng.random() < 0.12:
                lines.append(" " * rng.choice((0, 0, 4, 8)) + " ".join(line))
                line = []
        lines.append(" ".join(line))
        docs.append(f"doc {i}:\n" + "\n".join(lines) + "\n")
    return docs


def write_txt(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return make_docs(40)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, docs) -> Path:
    """A folder of 40 .txt documents."""
    return write_txt(tmp_path_factory.mktemp("corpus") / "txt", docs)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, docs) -> Path:
    from apr.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(docs + ["ünïcödé — 東京 🙂 text\n\tand\r\n tabs"], 400, out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture
def cli():
    """Run `apr ...` in-process; returns the click Result (stdout and stderr in .output)."""
    from apr.cli.main import app

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, [str(a) for a in args])

    return invoke


def assert_clean_failure(result, *needles: str) -> None:
    """Exit 1 through the CLI's own error path (no escaped exception), naming what went wrong."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), f"unhandled {result.exception!r}\n{result.output}"
    assert "Traceback" not in result.output
    assert result.output.startswith("error"), result.output
    for needle in needles:
        assert needle in result.output, f"{needle!r} not in:\n{result.output}"
