"""Data mixtures end to end: the plan's per-source accounting equals what the run draws and records,
the stage switch happens at the planned step, kill -9 and resume draws the same rows, and bad
mixture keys are findings with their key path (exit 1)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from apr.data.shards import write_dataset
from apr.monitor.state import normalize
from apr.monitor.view import messages
from tests.distributed.ranks import run_apr
from tests.train.run_helpers import BASE, SEQ, VOCAB, merge, run_until

ROWS = {"web": 60, "code": 40, "books": 24}
WORKER = Path(__file__).resolve().parent / "mix_worker.py"


def write_source(folder: Path, rows: int, seed: int, seq_len: int = SEQ, tokenizer_sha: str = "t" * 64,
                 documents: int | None = None) -> None:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCAB, size=rows + 8)
    data = ((starts[:, None] + np.arange(seq_len + 1)[None, :]) % VOCAB).astype(np.uint32)
    manifest = {"seq_len": seq_len, "row_len": seq_len + 1, "tokenizer": {"sha256": tokenizer_sha},
                "documents": documents or rows, "tokens_total": (rows + 8) * (seq_len + 1)}
    write_dataset(folder, {"train": data[:rows], "val": data[rows:]}, manifest, 16)


def corpus(root: Path) -> None:
    for i, (name, n) in enumerate(ROWS.items()):
        write_source(root / "data" / name, n, seed=10 + i)


def mixture_config(root: Path, *, stages=None, training=None, data=None) -> Path:
    sources = [{"name": "web", "path": str(root / "data/web/train"), "weight": 0.5, "val": str(root / "data/web/val")},
               {"name": "code", "path": str(root / "data/code/train"), "weight": 0.3,
                "val": str(root / "data/code/val")},
               {"name": "books", "path": str(root / "data/books/train"), "weight": 0.2}]
    doc = merge(BASE, {"data": {"train": sources, "val": None, **(data or {})},
                       "training": {"max_steps": 20, "eval_interval": 10, "save_interval": 5, "log_interval": 1,
                                    "output_dir": str(root / "run"), "epochs": 1, **(training or {})}})
    if stages is not None:
        doc["data"]["stages"] = stages
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m apr ARGS`` in ``cwd``, forked from the test worker's server (tests/distributed/ranks.py)."""
    env = {**os.environ, "APR_HOME": str(cwd / "home"), "OMP_NUM_THREADS": "1"}
    return run_apr(list(args), env, cwd=cwd)


def run_worker(cfg: Path, root: Path, log: Path, resume: bool = False, kill_at: str | None = None) -> int:
    env = {**os.environ, "APR_HOME": str(root / "home"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(WORKER), str(cfg), str(log)] + (["latest"] if resume else [])
    code, seen = run_until(cmd, env, kill_at)
    if kill_at is not None:
        assert code == -signal.SIGKILL, f"ended ({code}) before {kill_at!r}: {seen[-5:]}"
    else:
        assert code == 0, "".join(seen[-20:])
    return code


def draws(log: Path) -> dict[int, tuple]:
    """micro-batch number -> (rows as [source, row] pairs, sha256 of the token ids handed to the engine);
    a micro-batch drawn twice (before a kill and after the resume) must have been drawn the same."""
    out: dict[int, tuple] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        value = (tuple(map(tuple, entry["rows"])), entry["sha"])
        assert out.setdefault(entry["micro_batch"], value) == value, f"micro-batch {entry['micro_batch']} differs"
    return out


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory):
    """The plan and an uninterrupted run of a 3-source, 2-stage mixture with wsd decaying from stage 2."""
    root = tmp_path_factory.mktemp("mix")
    corpus(root)
    cfg = mixture_config(root, stages=[{"name": "main", "start": 0, "weights": {"web": 0.5, "code": 0.3, "books": 0.2}},
                                       {"name": "decay", "start": 0.75, "weights": {"code": 1.0}}],
                         training={"lr_scheduler": "wsd", "decay_stage": "decay", "warmup_steps": 0})
    plan = cli("train", "plan", str(cfg), "--json", cwd=root)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    log = root / "rows.jsonl"
    run_worker(cfg, root, log)
    return root, cfg, json.loads(plan.stdout), log


def test_the_plan_accounts_each_source_and_stage(two_stage):
    _, _, plan, _ = two_stage
    mix = plan["facts"]["mixture"]
    # 20 steps x 4 rows: stage main is steps 1-15 (60 rows at 0.5/0.3/0.2 = 30/18/12), decay 16-20 (20 rows of code)
    assert [(s["name"], s["first_step"], s["end_step"]) for s in mix["stages"]] == [("main", 1, 15), ("decay", 16, 20)]
    assert mix["stages"][0]["rows"] == {"web": 30, "code": 18, "books": 12}
    assert mix["stages"][1]["rows"] == {"web": 0, "code": 20, "books": 0}
    assert {n: s["rows_drawn"] for n, s in mix["sources"].items()} == {"web": 30, "code": 38, "books": 12}
    assert {n: s["tokens"] for n, s in mix["sources"].items()} == {"web": 30 * SEQ, "code": 38 * SEQ,
                                                                    "books": 12 * SEQ}
    assert mix["sources"]["code"]["epochs"] == pytest.approx(38 / 40)


def test_the_run_draws_and_records_what_the_plan_said(two_stage):
    root, _, plan, log = two_stage
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "finished"
    recorded = state["mixture"]["sources"]
    for name, planned in plan["facts"]["mixture"]["sources"].items():
        assert recorded[name]["tokens"] == planned["tokens"]
        assert recorded[name]["rows"] == planned["rows_drawn"]
        assert recorded[name]["epochs"] == pytest.approx(planned["epochs"])
    # the rows the engine got, by source: micro-batch k belongs to step k + 1 (batch 4, no accumulation)
    seen = draws(log)
    by_step = {k + 1: [s for s, _ in rows] for k, (rows, _) in seen.items()}
    assert sorted(by_step) == list(range(1, 21))
    assert all(src == "code" for step in range(16, 21) for src in by_step[step])  # decay: code only
    first = [s for step in range(1, 16) for s in by_step[step]]
    assert {n: first.count(n) for n in ROWS} == {"web": 30, "code": 18, "books": 12}
    # the stage switch is an event at its first step; the LR decays from there (wsd + decay_stage)
    assert [(e["kind"], e["step"]) for e in state["events"]] == [("stage", 16)]
    with sqlite3.connect(root / "run" / ".apr" / "experiments.db") as con:
        lrs = dict(con.execute("select step, value from metrics where key = 'lr'").fetchall())
    peak, floor = BASE["optimizer"]["lr"], BASE["optimizer"]["min_lr"]
    assert lrs[15] == pytest.approx(peak) and lrs[16] == pytest.approx(floor + (peak - floor) * 4 / 5)
    assert lrs[20] == pytest.approx(floor)


def test_the_monitor_shows_the_stage_and_each_sources_progress(two_stage):
    root, *_ = two_stage
    state, _ = normalize(json.loads((root / "run" / "training_state.json").read_text()))
    lines = [text for text, _style in messages(None, state, "finished", 0.0, 60.0, limit=20)]
    assert f"data stage decay: web {30 * SEQ} tok (0.50 ep)" in " ".join(lines)
    assert any(line.startswith("step 16 data stage 'decay' starts at step 16") for line in lines)
    assert not any("bad steps skipped" in line for line in lines)  # a stage event is not a problem


def test_tokens_and_val_loss_per_source_reach_the_stores(two_stage):
    root, *_ = two_stage
    db = root / "run" / ".apr" / "experiments.db"
    with sqlite3.connect(db) as con:
        names = {r[0] for r in con.execute("select distinct key from metrics")}
    assert {"tokens/web", "tokens/code", "tokens/books", "val_loss/web", "val_loss/code"} <= names
    assert "val_loss/books" not in names  # books has no val folder
    with sqlite3.connect(db) as con:  # no data.val: the sources' val folders measure the initial weights too
        first = {k: s for k, s in con.execute("select key, min(step) from metrics where key like 'val_loss%' "
                                               "group by key")}
    assert first == {"val_loss": 0, "val_loss/web": 0, "val_loss/code": 0}
    show = cli("runs", "show", json.loads((root / "run" / "training_state.json").read_text())["run_id"], cwd=root)
    assert show.returncode == 0 and "tokens/code" in show.stdout and "data stage 'decay' starts" in show.stdout


def test_kill_9_and_resume_draws_the_same_rows(two_stage, tmp_path):
    _, _, _, full_log = two_stage
    corpus(tmp_path)
    cfg = mixture_config(tmp_path, stages=[{"name": "main", "start": 0,
                                            "weights": {"web": 0.5, "code": 0.3, "books": 0.2}},
                                           {"name": "decay", "start": 0.75, "weights": {"code": 1.0}}],
                         training={"lr_scheduler": "wsd", "decay_stage": "decay", "warmup_steps": 0})
    log = tmp_path / "rows.jsonl"
    run_worker(cfg, tmp_path, log, kill_at="step 13/20")  # checkpoint at 10; stage 2 still ahead
    run_worker(cfg, tmp_path, log, resume=True)
    assert draws(log) == draws(full_log)  # every micro-batch, before and after the kill, as uninterrupted


def test_killed_on_2_ranks_and_resumed_on_1_the_mixture_draws_the_same_rows(two_stage, tmp_path):
    """Elastic: 2 ranks x batch 2 (the 4 rows a step of the uninterrupted 1-process run), killed at
    step 13, resumed in one process (accumulation 2): every row position of the run reads the row the
    uninterrupted run read, and each source's counts match."""
    root, _, _, full_log = two_stage
    corpus(tmp_path)
    cfg = mixture_config(tmp_path, data={"batch_size": 2},
                         stages=[{"name": "main", "start": 0, "weights": {"web": 0.5, "code": 0.3, "books": 0.2}},
                                 {"name": "decay", "start": 0.75, "weights": {"code": 1.0}}],
                         training={"lr_scheduler": "wsd", "decay_stage": "decay", "warmup_steps": 0})
    log = tmp_path / "rows.jsonl"
    env = {**os.environ, "APR_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "60"}
    code, seen = run_until([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(WORKER), str(cfg), str(log)], env, "step 13/20")
    assert code != 0, "".join(seen[-10:])
    run_worker(cfg, tmp_path, log, resume=True)

    def positions(path: Path) -> list[tuple]:
        at: dict[int, tuple] = {}
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            for j, row in enumerate(entry["rows"]):
                pos = entry["micro_batch"] * len(entry["rows"]) + j
                assert at.setdefault(pos, tuple(row)) == tuple(row), f"position {pos} read differently"
        return [at[p] for p in range(len(at))]

    assert positions(log) == positions(full_log)
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    full = json.loads((root / "run" / "training_state.json").read_text())
    assert {n: s["rows"] for n, s in state["mixture"]["sources"].items()} == \
        {n: s["rows"] for n, s in full["mixture"]["sources"].items()}


# ------------------------------------------------------------------------------------------ bad input


def _finding(proc, path: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert path in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("stages, data, path", [
    ([{"start": 0, "weights": {"web": -1.0, "code": 1.0}}], None, "data.stages[0].weights.web"),
    ([{"start": 0, "weights": {"web": 0, "code": 0}}], None, "data.stages[0].weights"),
    ([{"start": 0, "weights": {"web": 1.0, "news": 1.0}}], None, "data.stages[0].weights.news"),
    ([{"start": 0, "weights": {"web": 1.0}}, {"start": 0.9, "weights": {"code": 1}},
      {"start": 0.5, "weights": {"books": 1}}], None, "data.stages[2].start"),
    ([{"start": 5, "weights": {"web": 1.0}}], None, "data.stages[0].start"),
    ([{"start": True, "weights": {"web": 1.0}}], None, "data.stages[0].start"),
    ([{"name": "a", "start": 0, "weights": {"web": 1.0}}, {"name": "a", "start": 0.5, "weights": {"code": 1}}], None,
     "data.stages[1].name"),
    (None, {"train": [{"name": "web", "path": "data/web/train", "weight": -0.5}]}, "data.train[0].weight"),
])
def test_bad_weights_and_stages_are_findings_with_their_key(tmp_path, command, stages, data, path):
    corpus(tmp_path)
    cfg = mixture_config(tmp_path, stages=stages, data=data)
    _finding(cli("train", command, str(cfg), cwd=tmp_path), path)


def test_all_zero_source_weights_and_duplicate_names_are_refused(tmp_path):
    corpus(tmp_path)
    cfg = mixture_config(tmp_path)
    doc = yaml.safe_load(cfg.read_text())
    for s in doc["data"]["train"]:
        s["weight"] = 0
    cfg.write_text(yaml.safe_dump(doc))
    _finding(cli("train", "validate", str(cfg), cwd=tmp_path), "data.train")
    doc["data"]["train"][1]["name"] = "web"
    doc["data"]["train"][1]["weight"] = 1
    cfg.write_text(yaml.safe_dump(doc))
    _finding(cli("train", "validate", str(cfg), cwd=tmp_path), "data.train[1].name")


def test_a_stage_after_the_run_ends_is_a_plan_error(tmp_path):
    corpus(tmp_path)
    cfg = mixture_config(tmp_path, stages=[{"start": 0, "weights": {"web": 1.0}},
                                           {"start": 500, "weights": {"code": 1.0}}])
    assert cli("train", "validate", str(cfg), cwd=tmp_path).returncode == 0  # the run's length needs the data
    proc = cli("train", "plan", str(cfg), cwd=tmp_path)
    _finding(proc, "data.stages[1].start")
    assert "after the run ends" in proc.stdout + proc.stderr


@pytest.mark.parametrize("kw, what", [({"seq_len": SEQ * 2}, "seq_len"), ({"tokenizer_sha": "u" * 64}, "tokenizer")])
def test_sources_made_with_another_tokenizer_or_seq_len_are_refused(tmp_path, kw, what):
    corpus(tmp_path)
    write_source(tmp_path / "data" / "code", ROWS["code"], seed=11, **kw)
    proc = cli("train", "plan", str(mixture_config(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "data.train[1]" in proc.stdout and what in proc.stdout


def test_no_repeat_exhaustion_is_an_error_and_many_epochs_a_warning(tmp_path):
    corpus(tmp_path)
    # 100 steps x 4 rows, books 20% = 80 rows of 24: 3.3 epochs; code 30% = 120 of 40: 3 epochs; web 200 of 60
    cfg = mixture_config(tmp_path, training={"max_steps": 100, "epochs": 10}, data={"repeat": False})
    proc = cli("train", "plan", str(cfg), "--json", cwd=tmp_path)
    assert proc.returncode == 1
    errors = [f for f in json.loads(proc.stdout)["findings"] if f["severity"] == "error"]
    assert {f["path"] for f in errors} == {"data.repeat"} and len(errors) == 3
    cfg = mixture_config(tmp_path, training={"max_steps": 100, "epochs": 10},
                         data={"repeat": True, "train": [{"name": "web", "path": str(tmp_path / "data/web/train"),
                                                          "weight": 1.0},
                                                         {"name": "books", "path": str(tmp_path / "data/books/train"),
                                                          "weight": 1.0}]})
    proc = cli("train", "plan", str(cfg), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    warnings = [f for f in json.loads(proc.stdout)["findings"] if f["severity"] == "warning"]
    assert [f["path"] for f in warnings if f["code"] == "data.mixture"] == ["data.train[1]"]  # books: 200/24 epochs


def test_document_weights_are_converted_with_each_sources_tokens_per_document(tmp_path):
    corpus(tmp_path)
    write_source(tmp_path / "data" / "web", ROWS["web"], seed=10, documents=ROWS["web"] // 6)  # long documents
    cfg = mixture_config(tmp_path, data={"weight_unit": "documents", "train": [
        {"name": "web", "path": str(tmp_path / "data/web/train"), "weight": 1.0},
        {"name": "code", "path": str(tmp_path / "data/code/train"), "weight": 1.0}]})
    proc = cli("train", "plan", str(cfg), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    shares = json.loads(proc.stdout)["facts"]["mixture"]["stages"][0]["token_shares"]
    # equal documents, but a web document holds 6x the tokens of a code one (per their manifests)
    per_doc = {"web": (ROWS["web"] + 8) * (SEQ + 1) / (ROWS["web"] // 6), "code": (ROWS["code"] + 8) * (SEQ + 1) / 40}
    assert shares["web"] == pytest.approx(per_doc["web"] / (per_doc["web"] + per_doc["code"]))


def test_a_config_reads_the_same_rows_hash_as_it_plans(two_stage):
    """The plan file's data fingerprint covers every source (a changed source makes the plan stale)."""
    root, cfg, _, _ = two_stage
    plan = cli("train", "plan", str(cfg), "-out", str(root / "p.json"), "--overwrite", cwd=root)
    assert plan.returncode == 0
    doc = json.loads((root / "p.json").read_text())
    roles = {r["path"] for r in doc["data_fingerprint"]["roots"]}
    assert {str(root / f"data/{n}/train") for n in ROWS} <= roles
    shard = sorted((root / "data" / "books" / "train").glob("*.parquet"))[0]
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime: stale
    os.utime(shard, ns=(1, 1))
    proc = cli("train", "apply", str(root / "p.json"), cwd=root)
    assert proc.returncode == 1 and "stale" in proc.stderr + proc.stdout
    assert hashlib.sha256(shard.read_bytes()).hexdigest() == digest


def test_custom_targets_through_a_mixture_equal_the_causal_lm_when_they_are_the_ids(tmp_path):
    """training.mode: custom over a data mixture: every source's loader carries its targets beside the
    ids, the plan checks each source's shards for the column, and targets equal to the ids train the
    causal LM's weights and validation losses bit for bit."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from apr.apply import run_apply

    corpus(tmp_path)
    plain = mixture_config(tmp_path, training={"engine": "standard", "max_steps": 6, "eval_interval": 3,
                                               "save_interval": 6, "output_dir": str(tmp_path / "causal")})
    causal = run_apply(plain, apr_home=tmp_path / "home", echo=lambda line: None)
    missing = mixture_config(tmp_path, training={"engine": "standard", "max_steps": 6, "eval_interval": 3,
                                                 "save_interval": 6, "mode": "custom", "custom": {}})
    refused = cli("train", "plan", str(missing), "--json", cwd=tmp_path)
    assert refused.returncode == 1 and "targets" in refused.stdout and "data/web/train" in refused.stdout
    for shard in sorted((tmp_path / "data").rglob("*.parquet")):  # targets = the ids, beside them
        table = pq.read_table(shard)
        pq.write_table(table.append_column("targets", table.column("input_ids").cast(pa.list_(pa.int32()))), shard)
    custom = run_apply(missing, apr_home=tmp_path / "home", echo=lambda line: None)
    assert custom.val_loss == causal.val_loss and custom.first_val_loss == causal.first_val_loss
    a = load_file(str(tmp_path / "run" / "checkpoint-step-6.safetensors"))
    b = load_file(str(tmp_path / "causal" / "checkpoint-step-6.safetensors"))
    assert [k for k in a if not a[k].equal(b[k])] == []
