"""A hostile-input sweep (issue 24, "Done means"): many wrong or malicious files of each kind apr
reads (configs, data folders, tokenizers, checkpoints, plan files, state files), each run through
every command that reads it, in-process. Each must exit 1 (0 where the input is actually fine) with
the usual error format (no traceback, the file named), fast, and leave every existing file as it
was (hashed before and after)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.plan.examples import materialize

runner = CliRunner()
FAST_S = 30.0  # a hang guard, not a speed test (docs/performance.md times validate): validate/plan take
# about a second, several times that on a loaded 2-core machine; a bomb or a fan-out takes minutes


# ------------------------------------------------------------------------------------------ helpers


def tree_hashes(*roots: Path) -> dict[str, str]:
    """SHA-256 of every regular file under ``roots`` (FIFOs and devices are skipped, never read)."""
    out = {}
    for root in roots:
        paths = [root] if not root.is_dir() else [p for p in root.rglob("*")]
        for p in paths:
            # .apr-run.lock is apr's own lock: each apply that takes it records its pid and host there
            if p.is_file() and not p.is_symlink() and os.access(p, os.R_OK) and p.name != ".apr-run.lock":
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def flat(text: str) -> str:
    """Output without whitespace: findings wrap to the terminal's width (at hyphens and slashes too)."""
    return "".join(text.split())


def run_cli(args: list[str], *, expect: int | tuple[int, ...] = 1, names: str | None = None,
            fast: bool = True, untouched: tuple[Path, ...] = ()) -> str:
    before = tree_hashes(*untouched)
    start = time.monotonic()
    result = runner.invoke(app, args)
    elapsed = time.monotonic() - start
    out = result.output
    crash = result.exception if not isinstance(result.exception, SystemExit) else None
    assert crash is None, f"apr {' '.join(args)} raised {type(crash).__name__}: {crash}\n{out}"
    assert "Traceback" not in out, out
    codes = expect if isinstance(expect, tuple) else (expect,)
    assert result.exit_code in codes, f"apr {' '.join(args)} exited {result.exit_code}, expected {codes}\n{out}"
    if result.exit_code == 1:
        assert "error" in out, out
        if names is not None:
            assert flat(str(names)) in flat(out), f"{names} not named in:\n{out}"
    if fast:
        assert elapsed < FAST_S, f"apr {' '.join(args)} took {elapsed:.2f} s"
    after = tree_hashes(*untouched)
    changed = sorted(p for p in before if after.get(p) != before[p])
    assert not changed, f"apr {' '.join(args)} changed existing files: {changed}"
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A valid config with its shards and tokenizer (read-only to the cases)."""
    root = tmp_path_factory.mktemp("hostile")
    config, _ = materialize({}, root / "run")
    return root / "run", config.read_text()


# ------------------------------------------------------------------------------------------ configs


def _alias_bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def _deep(n: int = 10_000) -> str:
    return "a: " + "[" * n + "]" * n + "\n"


def _wrong_types(text: str):
    """The base config with one key's value replaced by a value of the wrong type, for every key."""
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe")
    doc = yaml.load(text)

    def leaves(node, path=()):
        if isinstance(node, dict):
            yield path, node
            for k, v in node.items():
                yield from leaves(v, path + (k,))
        else:
            yield path, node

    for path, value in leaves(doc):
        if not path:
            continue
        for bad in ({"x": 1}, [1, 2], "not-a-number" if not isinstance(value, str) else 12345, None, True):
            if isinstance(value, bool) and isinstance(bad, bool):
                continue
            changed = json.loads(json.dumps(doc))
            node = changed
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = bad
            yield ".".join(path), json.dumps(changed)  # JSON is YAML


CONFIG_CASES = {
    "binary": lambda t: np.random.default_rng(0).bytes(4000),
    "nul": lambda t: t.replace("batch_size: 2", "batch_size: 2\0"),
    "tabs": lambda t: t.replace("  batch_size", "\tbatch_size"),
    "duplicate_keys": lambda t: t.replace("  batch_size: 2", "  batch_size: 2\n  batch_size: 4"),
    "huge_int": lambda t: t.replace("batch_size: 2", "batch_size: " + "9" * 400),
    "negative_size": lambda t: t.replace("batch_size: 2", "batch_size: -2"),
    "negative_vram": lambda t: t.replace("device: cpu", "device: cpu\n  vram: -24GiB"),
    "unicode_key": lambda t: t.replace("batch_size: 2", "batch_size: 2\n  bätch_sïze\u202e: 2"),
    "empty": lambda t: "",
    "only_comment": lambda t: "# nothing\n",
    "list": lambda t: "- a\n- b\n",
    "scalar": lambda t: "42\n",
    "deep": lambda t: _deep(),
    "deep_mapping": lambda t: "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "v: 1\n",
    "alias_bomb": lambda t: _alias_bomb(),
    "big_50mb": lambda t: t + "# " + "x" * (50 * 2**20) + "\n",
    "inf": lambda t: t.replace("lr: 0.0003", "lr: .inf"),
    "nan_seed": lambda t: t.replace("epochs: 1", "epochs: 1\n  seed: .nan"),
    "huge_seed": lambda t: t.replace("epochs: 1", "epochs: 1\n  seed: " + str(2**70)),
    "unknown_section": lambda t: t + "bogus:\n  x: 1\n",
    "merge_key": lambda t: t.replace("optimizer:\n", "base: &b {lr: 1}\noptimizer:\n  <<: *b\n"),
    "bad_yaml": lambda t: t.replace("batch_size: 2", "batch_size: [2"),
    "crlf": lambda t: t.replace("\n", "\r\n"),
    "bom": lambda t: "\ufeff" + t,
    "latin1": lambda t: (t + "# caf\xe9\n").encode("latin-1"),
    "output_dir_root": lambda t: t.replace("output_dir: run/", "output_dir: /"),
    "output_dir_is_data": lambda t: t.replace("output_dir: run/", "output_dir: " + t.split("train: ")[1].split()[0]),
    # planning walks every file under a data folder: a root or the home folder took minutes
    "data_root": lambda t: t.replace("train: " + t.split("train: ")[1].split()[0], "train: /"),
    "data_home": lambda t: t.replace("val: " + t.split("val: ")[1].split()[0], "val: ~/"),
    "model_path": lambda t: t.replace("model:\n", "model:\n  path: /tmp/x.safetensors\n"),
    "experiment_escape": lambda t: t + "monitoring:\n  tracking:\n    experiment: \"\\e[2J\"\n",
    "alert_parens": lambda t: t + "monitoring:\n  alerts:\n  - condition: \"" + "(" * 100_000 + "\"\n",
    "alert_unknown_metric": lambda t: t + "monitoring:\n  alerts:\n  - condition: \"lossy > 1\"\n",
}
FINE = {"crlf", "bom"}  # a valid config in another encoding of lines: accepted


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_hostile_configs_fail_validate_and_plan_cleanly(tmp_path, base, case):
    run, text = base
    content = CONFIG_CASES[case](text)
    cfg = tmp_path / "config.yaml"
    (cfg.write_bytes if isinstance(content, bytes) else lambda c: cfg.write_text(c, newline=""))(content)
    expect = 0 if case in FINE else 1
    for args in (["train", "validate", str(cfg)], ["train", "plan", str(cfg)], ["train", "plan", str(cfg), "--json"]):
        run_cli(args, expect=expect, names=str(cfg) if expect else None, untouched=(cfg, run))


@pytest.mark.parametrize("case", ["binary", "alias_bomb", "deep", "big_50mb", "list", "output_dir_root"])
def test_hostile_configs_fail_apply_before_anything_is_written(tmp_path, base, case):
    run, text = base
    cfg = tmp_path / "config.yaml"
    content = CONFIG_CASES[case](text)
    cfg.write_bytes(content) if isinstance(content, bytes) else cfg.write_text(content)
    run_cli(["train", "apply", str(cfg)], names=str(cfg), untouched=(cfg, run))
    assert sorted(os.listdir(tmp_path)) == ["config.yaml"]


def test_every_key_with_a_wrong_type_fails_validate_at_its_key(tmp_path, base):
    from apr.config import load_config
    from apr.errors import AprError

    run, text = base
    cfg = tmp_path / "config.yaml"
    checked = 0
    for key, content in _wrong_types(text):
        cfg.write_text(content)
        try:
            load_config(cfg)
        except AprError as err:
            assert err.findings and all(f.file == str(cfg) for f in err.findings), (key, err.findings)
            checked += 1
        except Exception as e:  # pragma: no cover - the failure this test exists to catch
            raise AssertionError(f"{key}: {type(e).__name__}: {e}") from None
    assert checked > 60


@pytest.mark.parametrize("kind", ["fifo", "folder", "devzero", "dangling", "loop"])
def test_a_config_that_is_not_a_regular_file_is_named(tmp_path, kind):
    cfg = tmp_path / "config.yaml"
    if kind == "fifo":
        os.mkfifo(cfg)
    elif kind == "folder":
        cfg.mkdir()
    elif kind == "devzero":
        cfg.symlink_to("/dev/zero")
    elif kind == "dangling":
        cfg.symlink_to(tmp_path / "gone.yaml")
    else:
        cfg.symlink_to(cfg)
    for args in (["train", "validate", str(cfg)], ["train", "plan", str(cfg)], ["train", "apply", str(cfg)]):
        run_cli(args, names=str(cfg))


# ------------------------------------------------------------------------------------- data folders


def _mixed_seq_len(folder: Path) -> None:
    from apr.plan.examples import write_shards

    write_shards(folder / "other", rows=8, row_len=17, max_token=100)


def _garbage_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_bytes(np.random.default_rng(2).bytes(300))


def _lying_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text(json.dumps({"format_version": 1, "rows": 10**12, "seq_len": 5}))


DATA_CASES = {  # name -> (materialize example, extra damage, exit code of plan)
    "float_tokens": ({"train": {"dtype": "float32"}}, None, 1),
    "string_tokens": ({"train": {"dtype": "string"}}, None, 1),
    "plain_column": ({"train": {"list": False}}, None, 1),
    # rows of 34 and 32 tokens: the footer's average (33) looks right; the loader checks each row
    "ragged_rows": ({"train": {"ragged": True}}, None, 0),
    "no_shards": ({"train": {"empty": True}}, None, 1),
    "missing": ({"train": {"missing": True}}, None, 1),
    "garbage_shard": ({"train": {"corrupt": True}}, None, 1),
    "wrong_column": ({"train": {"column": "text_ids"}}, None, 1),
    "ids_beyond_vocab": ({"train": {"max_token": 100_000}}, None, 1),
    "wrong_seq_len": ({"train": {"row_len": 20}}, None, 1),
    "mixed_seq_len": ({}, _mixed_seq_len, 1),
    "garbage_manifest": ({}, _garbage_manifest, 0),  # the plan reads shards' footers, never the manifest
    "lying_manifest": ({}, _lying_manifest, 0),
    "tokenizer_corrupt": ({"tokenizer": {"corrupt": True}}, None, 1),
    "tokenizer_missing": ({"tokenizer": {"missing": True}}, None, 1),
    "tokenizer_larger_than_the_model": ({"tokenizer": {"vocab_size": 1000}}, None, 1),
}


def _tokenizer_damage(kind: str):
    def damage(folder: Path) -> None:
        tok = folder.parent / "tokenizer.json"
        text = tok.read_text()
        if kind == "truncated":
            tok.write_text(text[: len(text) // 2])
        elif kind == "wrong_schema":
            tok.write_text(json.dumps({"model": {"type": "BPE", "vocab": [1, 2, 3]}, "added_tokens": "x"}))
        elif kind == "deep":
            tok.write_text("[" * 100_000 + "]" * 100_000)
        elif kind == "fifo":
            tok.unlink()
            os.mkfifo(tok)
    return damage


for _kind in ("truncated", "wrong_schema", "deep", "fifo"):
    DATA_CASES[f"tokenizer_{_kind}"] = ({}, _tokenizer_damage(_kind), 1)


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_hostile_data_and_tokenizers_fail_the_plan_cleanly(tmp_path, case):
    example, damage, expect = DATA_CASES[case]
    cfg, _ = materialize(example, tmp_path / "run")
    if damage is not None:
        damage(tmp_path / "run" / "train")
    for args in (["train", "plan", str(cfg)], ["train", "plan", str(cfg), "--json"]):
        out = run_cli(args, expect=expect, untouched=(tmp_path,))
        if expect:
            assert "C-DATA" in out or "C-TOK" in out or "error[" in out, out


@pytest.mark.parametrize("case", ["garbage_shard", "tokenizer_truncated", "mixed_seq_len", "ragged_rows"])
def test_hostile_data_fails_apply_before_training(tmp_path, case):
    example, damage, _ = DATA_CASES[case]
    example = {**example, "config": {"training": {"output_dir": str(tmp_path / "out")}}}
    cfg, _ = materialize(example, tmp_path / "run")
    if damage is not None:
        damage(tmp_path / "run" / "train")
    run_cli(["train", "apply", str(cfg)], fast=False, untouched=(tmp_path / "run",))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("checkpoint-*"))


def test_ids_the_plan_cannot_see_stop_apply_with_the_shard_named(tmp_path):
    cfg, _ = materialize({"train": {"statistics": False, "max_token": 100_000},
                          "config": {"training": {"output_dir": str(tmp_path / "out")}}}, tmp_path / "run")
    out = run_cli(["train", "apply", str(cfg)], fast=False, untouched=(tmp_path / "run",))
    assert "shard-" in out and "vocab_size" in out


# --------------------------------------------------------------------------------------- plan files


def _plan_cases(doc: dict) -> dict:
    def edit(**changes):
        d = json.loads(json.dumps(doc))
        for dotted, value in changes.items():
            node = d
            *parents, last = dotted.split("/")
            for k in parents:
                node = node[k]
            node[last] = value
        return json.dumps(d)

    text = json.dumps(doc)
    return {
        "truncated": text[: len(text) // 2],
        "not_json": "plan? no",
        "binary": np.random.default_rng(3).bytes(2000),
        "empty": "",
        "list": "[1, 2]",
        "future_version": edit(format_version=999),
        "foreign_format": edit(format="terraform-plan"),
        "no_config_path": json.dumps({k: v for k, v in doc.items() if k != "config_path"}),
        "config_path_number": edit(config_path=5),
        "config_path_devzero": edit(config_path="/dev/zero"),
        "config_path_missing": edit(config_path="/nonexistent/config.yaml"),
        "config_hash_edited": edit(config_hash="0" * 64),
        "fingerprint_wrong_types": edit(**{"data_fingerprint/files": [{"path": 1, "size": "big"}]}),
        "fingerprint_not_list": edit(**{"data_fingerprint/files": "all"}),
        "fingerprint_lies": edit(**{"data_fingerprint/files": [{"path": "/x", "size": 1, "mtime_ns": 1}]}),
        "overrides_list": edit(overrides=[1, 2]),
        "target_garbage": edit(target={"gpu": 5, "vram": [1]}),
        "deep": "[" * 100_000 + "]" * 100_000,
        "huge": '{"x": "' + "y" * (17 * 2**20) + '"}',
    }


def test_hostile_plan_files_are_refused_by_apply(tmp_path, base):
    run, text = base
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text.replace("output_dir: run/", f"output_dir: {tmp_path / 'out'}"))
    plan = tmp_path / "plan.json"
    run_cli(["train", "plan", str(cfg), "-out", str(plan)], expect=0)
    doc = json.loads(plan.read_text())
    for case, content in _plan_cases(doc).items():
        bad = tmp_path / f"{case}.json"
        bad.write_bytes(content) if isinstance(content, bytes) else bad.write_text(content)
        run_cli(["train", "apply", str(bad)], names=None, untouched=(bad, cfg, run))
        assert not (tmp_path / "out").exists(), case
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    run_cli(["train", "apply", str(fifo)], names=str(fifo))


# -------------------------------------------------------------------------------------- state files


STATE_CASES = {
    "garbage": lambda s: np.random.default_rng(4).bytes(500),
    "truncated": lambda s: s[: len(s) // 2],
    "empty": lambda s: "",
    "list": lambda s: "[]",
    "deep": lambda s: "[" * 100_000 + "]" * 100_000,
    "huge": lambda s: '{"x": "' + "y" * (17 * 2**20) + '"}',
    "wrong_types": lambda s: json.dumps({**json.loads(s), "step": "x", "loss": [1], "status": 5,
                                         "loss_history": "no", "gpu": "hot"}),
    "nan": lambda s: s.replace('"status"', '"loss": NaN, "status"', 1),
    "escapes": lambda s: json.dumps({**json.loads(s), "experiment": "\x1b[2J\x1b]0;owned\x07"}),
}


@pytest.fixture(scope="module")
def state_text():
    """A recorded training_state.json (tests/monitor/fixtures), the base of the damaged ones."""
    fixtures = Path(__file__).resolve().parents[1] / "monitor" / "fixtures"
    found = sorted(fixtures.rglob("training_state.json"))
    assert found, "tests/monitor/fixtures holds recorded state files"
    return found[0].read_text()


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_hostile_state_files_for_the_json_monitor(tmp_path, state_text, case):
    content = STATE_CASES[case](state_text)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state = run_dir / "training_state.json"
    state.write_bytes(content) if isinstance(content, bytes) else state.write_text(content)
    malformed = case in ("garbage", "truncated", "empty", "list", "deep", "huge")
    out = run_cli(["monitor", str(run_dir), "--json", "--no-history"], expect=1 if malformed else (0, 1),
                  names=str(state) if malformed else None, untouched=(run_dir,))
    assert "\x1b" not in out


def test_a_fifo_state_file_does_not_hang_the_monitor(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "training_state.json")
    run_cli(["monitor", str(run_dir), "--json"], expect=(0, 1))


# -------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run with one checkpoint (and the best one)."""
    from apr.apply import run_apply

    root = tmp_path_factory.mktemp("trained")
    cfg, _ = materialize({"config": {"training": {"max_steps": 4, "save_interval": 2, "eval_interval": 2,
                                                  "warmup_steps": 1, "output_dir": str(root / "out")}}},
                         root / "run")
    result = run_apply(cfg, apr_home=root / "home", echo=lambda line: None)
    assert result.status == "finished"
    # run_apply leaves a store connection to be finalized by the garbage collector (its WAL is
    # checkpointed then): collect now, so that a later case does not see the store change under it
    import gc

    gc.collect()
    return root, cfg


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(path: Path, header: dict, n: int, body: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()  # offsets count from the data: any length works
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def _weights_damage(kind: str):
    def damage(weights: Path, sidecar: Path) -> None:
        n, header, body = _header(weights)
        first = next(k for k in header if k != "__metadata__")
        if kind == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif kind == "header_huge_length":
            weights.write_bytes((2**62).to_bytes(8, "little") + weights.read_bytes()[8:])
        elif kind == "header_garbage":
            weights.write_bytes(n.to_bytes(8, "little") + b"\xff" * n + body)
        elif kind == "offsets_huge":
            header[first]["data_offsets"] = [0, 2**60]
            _with_header(weights, header, n, body)
        elif kind == "wrong_dtype":
            start, end = header[first]["data_offsets"]
            header[first]["dtype"] = "F16"  # half the bytes: a consistent file of the wrong dtype
            header[first]["data_offsets"] = [start, start + (end - start) // 2]
            _with_header(weights, header, n, body)
        elif kind == "wrong_shape":
            header[first]["shape"] = header[first]["shape"][:1]  # fewer elements than its bytes hold
            _with_header(weights, header, n, body)
        elif kind == "flipped_byte":
            raw = bytearray(weights.read_bytes())
            raw[-10] ^= 0xFF
            weights.write_bytes(bytes(raw))
        elif kind == "empty":
            weights.write_bytes(b"")
        elif kind == "fifo":
            weights.unlink()
            os.mkfifo(weights)
    return damage


def _sidecar_damage(kind: str):
    def damage(weights: Path, sidecar: Path) -> None:
        doc = json.loads(sidecar.read_text())
        if kind == "garbage":
            sidecar.write_bytes(np.random.default_rng(5).bytes(400))
        elif kind == "truncated":
            sidecar.write_text(sidecar.read_text()[:200])
        elif kind == "deep":
            sidecar.write_text("[" * 100_000 + "]" * 100_000)
        elif kind == "list":
            sidecar.write_text("[]")
        elif kind == "no_data":
            sidecar.write_text(json.dumps({k: v for k, v in doc.items() if k not in ("data", "engine", "rng")}))
        elif kind == "wrong_types":
            sidecar.write_text(json.dumps({**doc, "step": "four", "weights_size": -1, "data": [1]}))
        elif kind == "arch_edited":
            config = doc.get("config")
            assert isinstance(config, dict), "the sidecar records the resolved config"
            config["model"]["architecture"]["hidden_size"] = 128
            sidecar.write_text(json.dumps(doc))
    return damage


CHECKPOINT_CASES = {**{f"weights_{k}": _weights_damage(k) for k in (
    "truncated", "header_huge_length", "header_garbage", "offsets_huge", "wrong_dtype", "wrong_shape",
    "flipped_byte", "empty", "fifo")},
    **{f"sidecar_{k}": _sidecar_damage(k) for k in (
        "garbage", "truncated", "deep", "list", "no_data", "wrong_types", "arch_edited")}}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_hostile_checkpoints_are_refused_by_every_reader(tmp_path, trained, case):
    root, cfg = trained
    out = tmp_path / "out"
    shutil.copytree(root / "out", out, symlinks=True, ignore=shutil.ignore_patterns(".apr-run.lock"))
    weights, sidecar = out / "checkpoint-step-4.safetensors", out / "checkpoint-step-4.json"
    CHECKPOINT_CASES[case](weights, sidecar)
    data = root / "run" / "val"
    source = str(sidecar)
    # the trainer state (data cursor, engine, RNG) is only needed to resume: readers of the weights are fine
    readers_ok = case == "sidecar_no_data"
    commands = [["export", source, "--out", str(tmp_path / "hf")], ["generate", source, "-p", "hi", "-n", "2"],
                ["eval", source, "--data", str(data)]]
    for args in commands:
        run_cli(args, expect=0 if readers_ok else 1, fast=False, untouched=(out, root / "run"))
    assert (tmp_path / "hf").exists() == readers_ok
    resume_cfg = tmp_path / "config.yaml"
    resume_cfg.write_text(cfg.read_text().replace(str(root / "out"), str(out)))
    run_cli(["train", "apply", str(resume_cfg), "--resume", str(sidecar)], fast=False,
            untouched=(root / "run",))


# ----------------------------------------------------- files given on the command line of other commands


def _hostile_file(path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(np.random.default_rng(6).bytes(3000))
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "loop":
        path.symlink_to(path)
    return path


FILE_KINDS = ["fifo", "folder", "binary", "deep", "empty", "devzero", "loop"]


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_hostile_tokenizer_prompt_and_task_files_given_as_options(tmp_path, trained, kind):
    root, _ = trained
    ckpt = str(root / "out" / "checkpoint-step-4.json")
    tok = _hostile_file(tmp_path / "tokenizer.json", kind)
    prompts = _hostile_file(tmp_path / "prompts.txt", kind)
    task = _hostile_file(tmp_path / "task.jsonl", kind)
    for args in (["generate", ckpt, "-p", "hi", "-n", "2", "--tokenizer", str(tok)],
                 ["export", ckpt, "--out", str(tmp_path / "hf"), "--tokenizer", str(tok)],
                 ["eval", ckpt, "--data", str(root / "run" / "val"), "--tokenizer", str(tok)],  # given: never ignored
                 ["eval", ckpt, "--task", str(task)]):
        run_cli(args, fast=False, untouched=(root / "out", root / "run"))
    # a prompt file is text: deep brackets or any bytes that are UTF-8 are prompts like any other
    run_cli(["generate", ckpt, "-n", "2", "--prompt-file", str(prompts)], expect=0 if kind == "deep" else 1,
            fast=False, untouched=(root / "out", root / "run"))
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def eot_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE with <|endoftext|> (pretokenize needs one), trained by `apr data train-tokenizer`."""
    root = tmp_path_factory.mktemp("tok")
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import"]
    rng = np.random.default_rng(7)
    (root / "small.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(400)))
    run_cli(["data", "train-tokenizer", str(root / "small.txt"), "--vocab-size", "280", "--out",
             str(root / "tok.json")], expect=0, fast=False)
    return root / "tok.json"


def _corpus(path: Path, kind: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind in FILE_KINDS:
        return _hostile_file(path, kind)
    if kind == "deep_jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    elif kind == "jsonl_wrong_type":
        path = path.with_suffix(".jsonl")
        path.write_text('{"text": 5}\n')
    elif kind == "jsonl_no_key":
        path = path.with_suffix(".jsonl")
        path.write_text('{"body": "a"}\n')
    elif kind == "parquet_int_text":
        path = path.with_suffix(".parquet")
        pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    elif kind == "parquet_garbage":
        path = path.with_suffix(".parquet")
        path.write_bytes(np.random.default_rng(8).bytes(2000))
    return path


@pytest.mark.parametrize("kind", ["fifo", "binary", "devzero", "loop", "empty", "deep_jsonl", "jsonl_wrong_type",
                                  "jsonl_no_key", "parquet_int_text", "parquet_garbage"])
def test_hostile_corpora_for_the_data_commands(tmp_path, eot_tokenizer, kind):
    corpus = _corpus(tmp_path / "corpus.txt", kind)
    # bytes are text to a byte-level BPE: binary (not UTF-8) and empty .txt files are refused or
    # skipped by their own rules, never a crash
    expect = (0, 1) if kind in ("binary", "empty") else (1,)
    names = None if kind in ("binary", "empty") else corpus.name
    run_cli(["data", "train-tokenizer", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "tok.json")],
            expect=expect, names=names, fast=False, untouched=(eot_tokenizer,))
    run_cli(["data", "pretokenize", str(corpus), "--tokenizer", str(eot_tokenizer), "--seq-len", "16",
             "--out", str(tmp_path / "data")], expect=expect, names=names, fast=False, untouched=(eot_tokenizer,))
    if expect == (1,):
        assert not (tmp_path / "tok.json").exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("kind", ["binary", "empty", "fifo", "folder", "text_in_real_column"])
def test_hostile_experiment_stores(tmp_path, trained, kind, monkeypatch):
    import sqlite3

    root, _ = trained
    store = tmp_path / "experiments.db"
    if kind == "text_in_real_column":
        shutil.copy(root / "out" / ".apr" / "experiments.db", store)
        conn = sqlite3.connect(store)
        conn.execute("UPDATE metrics SET value = 'high'")
        conn.commit()
        conn.close()
    else:
        _hostile_file(store, kind)
    monkeypatch.chdir(tmp_path)
    run_cli(["experiment", "view", "--db", str(store)], untouched=(tmp_path,) if kind != "fifo" else ())
    run_cli(["experiment", "export", "--db", str(store), "--run", "x", "--format", "csv", "--out",
             str(tmp_path / "m.csv")], untouched=(tmp_path,) if kind != "fifo" else ())
    assert not (tmp_path / "m.csv").exists()


# ------------------------------------------------------------------------------------ option values


def _option_cases(cfg: str, ckpt: str, data: str) -> list[list[str]]:
    return [
        ["train", "plan", cfg, "--vram", "24"], ["train", "plan", cfg, "--vram", "-1GiB"],
        ["train", "plan", cfg, "--vram", "lots"], ["train", "plan", cfg, "--vram", "1e400GiB"],
        ["train", "plan", cfg, "--gpu", "no-such-gpu"], ["train", "plan", cfg, "--world-size", "0"],
        ["train", "plan", cfg, "--gpu", "\x1b[2J"],
        ["train", "apply", cfg, "--max-steps", "0"], ["train", "apply", cfg, "--seed", str(2**70)],
        ["train", "apply", cfg, "--device", "tpu"], ["train", "apply", cfg, "--resume", "/nonexistent.json"],
        ["train", "apply", cfg, "--force"],
        ["export", ckpt, "--format", "onnx", "--out", "/tmp/never-written-by-apr-tests"],
        ["generate", ckpt, "-p", "hi", "-n", "-1"], ["generate", ckpt, "-p", "hi", "--temperature", "nan"],
        ["generate", ckpt, "-p", "hi", "--top-p", "2"], ["generate", ckpt, "-p", "hi", "--top-k", "-3"],
        ["generate", ckpt, "-p", "hi", "--device", "tpu"],
        ["eval", ckpt, "--data", data, "--batch-size", "0"], ["eval", ckpt, "--data", data, "--max-batches", "-1"],
        ["eval", ckpt, "--task", "no-such-task"], ["eval", ckpt, "--task", "stdlib-nextline", "--limit", "0"],
        ["monitor", "/nonexistent-run", "--json"], ["monitor", ".", "--json", "--refresh", "-5"],
        ["runs", "show", "../../etc/passwd"], ["runs", "show", "\x1b[2J"],
        ["data", "train-tokenizer", cfg, "--vocab-size", "1e20", "--out", "/tmp/never-written-by-apr-tests.json"],
    ]


def test_hostile_option_values_are_usage_errors(tmp_path, trained):
    root, cfg = trained
    ckpt = str(root / "out" / "checkpoint-step-4.json")
    for args in _option_cases(str(cfg), ckpt, str(root / "run" / "val")):
        out = run_cli(args, expect=(1, 2), fast=False, untouched=(root / "out", root / "run"))
        assert "\x1b" not in out, args
    assert not os.path.exists("/tmp/never-written-by-apr-tests")
    assert not os.path.exists("/tmp/never-written-by-apr-tests.json")


def test_local_stores_that_are_not_databases_are_warned_about_and_skipped(tmp_path, monkeypatch):
    for name, kind in (("a", "fifo"), ("b", "binary"), ("c", "folder"), ("d", "devzero")):
        (tmp_path / name / ".apr").mkdir(parents=True)
        _hostile_file(tmp_path / name / ".apr" / "experiments.db", kind)
    monkeypatch.chdir(tmp_path)
    out = run_cli(["runs", "ls"], expect=0)
    for name, word in (("a", "FIFO"), ("b", "not a database"), ("c", "directory"), ("d", "character device")):
        assert f"{tmp_path / name / '.apr' / 'experiments.db'}:" in out and word in out, (name, out)
    run_cli(["runs", "ls", "--json"], expect=0)
    run_cli(["runs", "show", "20261122"], expect=1)
