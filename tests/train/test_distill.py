"""Blockwise distillation (training.mode: distill): the mechanics of both phases, the block mapping,
the autotune, a run from a trained teacher that resumes bitwise across a kill -9, the plan's teacher
memory and phases, and bad teacher/student combinations refused with their key path."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from apr.config.schema import AprConfig, AutotuneConfig
from apr.steps.distill import MappingError, phase_at, spans
from apr.steps.resolved import resolve as plan_of
from apr.train.distill import Autotune
from tests.distributed.ranks import run_apr
from tests.train.run_helpers import config_doc, make_dataset, run_until

WORKER = Path(__file__).resolve().parent / "run_worker.py"


def _env(root: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "APR_HOME": str(root / "home")}


def _run(cfg: Path, root: Path, resume: bool = False, kill_at: str | None = None) -> list[str]:
    cmd = [sys.executable, str(WORKER), str(cfg)] + (["latest"] if resume else [])
    code, seen = run_until(cmd, _env(root), kill_at)
    assert code == (-signal.SIGKILL if kill_at else 0), "".join(seen[-20:])
    return seen


def _write(root: Path, name: str, doc: dict) -> Path:
    path = root / name
    path.write_text(json.dumps(doc))
    return path


def _student_doc(root: Path, teacher: Path, **distill) -> dict:
    return config_doc(root, model={"architecture": {"num_hidden_layers": 2}},
                      training={"mode": "distill", "engine": "standard", "max_steps": 8, "save_interval": 2,
                                "log_interval": 1, "eval_interval": 4, "output_dir": "student/",
                                "distill": {"teacher": str(teacher), "phase1_steps": 2, **distill}})


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 4-block model trained briefly on the test corpus: the teacher (its run folder)."""
    root = tmp_path_factory.mktemp("teacher")
    make_dataset(root)
    doc = config_doc(root, model={"architecture": {"num_hidden_layers": 4}},
                     training={"max_steps": 6, "save_interval": 6, "output_dir": "teacher/"})
    _run(_write(root, "teacher.json", doc), root)
    return root / "teacher"


def test_spans_split_evenly_or_follow_the_map_and_refuse_gaps():
    assert spans(2, 4, None) == [(0, 2), (2, 4)] and spans(4, 4, None) == [(i, i + 1) for i in range(4)]
    assert spans(2, 5, [[0, 3], [3, 5]]) == [(0, 3), (3, 5)]
    for student, teacher_depth, block_map in ((3, 4, None), (2, 4, [[0, 2]]), (2, 4, [[0, 2], [3, 4]]),
                                              (2, 4, [[0, 2], [2, 3]]), (2, 4, [[0, 0], [0, 4]])):
        with pytest.raises(MappingError):
            spans(student, teacher_depth, block_map)


def test_a_student_copied_from_its_teacher_has_zero_loss_in_both_phases(teacher, tmp_path):
    """Mechanics: with a 1:1 mapping and the student initialised from the teacher, every phase-1
    block loss and the phase-2 KD loss are exactly zero."""
    from apr.train.build import build_engine

    make_dataset(tmp_path)
    doc = _student_doc(tmp_path, teacher, kd_weight=1.0)
    doc["model"]["architecture"]["num_hidden_layers"] = 4
    engine = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    for block in range(4):
        assert engine.loss.block_loss_of(engine, engine.model, block, ids).item() == 0.0
    assert engine.loss.kd_loss(engine, engine.model, ids, ids).item() == pytest.approx(0.0, abs=1e-6)
    doc["model"]["architecture"]["num_hidden_layers"] = 2  # two teacher blocks per student block: not a copy
    half = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    assert half.loss.block_loss_of(half, half.model, 0, ids).item() > 0.0


def test_phase_1_updates_only_the_block_in_training(teacher, tmp_path):
    from apr.train.build import build_engine

    make_dataset(tmp_path)
    config = AprConfig.model_validate(_student_doc(tmp_path, teacher))
    engine = build_engine(plan_of(config), "cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    batch = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(1))
    engine.current_step = 3  # phase 1, block 1 (2 steps per block)
    assert phase_at(config, 3) == (1, 1)
    engine.train_step([batch], 1e-2)
    after = engine.model.state_dict()
    changed = {k for k in before if not after[k].equal(before[k])}
    assert changed and all(k.startswith("model.layers.1.") for k in changed)


def test_autotune_records_spikes_and_plateaus_and_only_active_mode_lowers_the_lr():
    for mode, factor in (("monitor", 1.0), ("active", 0.5)):
        tune = Autotune(AutotuneConfig(mode=mode, spike_factor=2.0, plateau_patience=3), blocks=2)
        for loss in (1.0, 0.9, 0.8, 5.0):  # the last one is a spike
            tune.observe(0, loss)
        assert [e[2]["block"] for e in tune.events] == [0] and "spike" in tune.events[0][1]
        assert tune.factor[0] == factor and tune.factor[1] == 1.0
        tune.events.clear()
        for _ in range(3):  # no new best for 3 steps: a plateau
            tune.observe(1, 1.0)
            tune.observe(1, 1.0)
        assert any("plateau" in e[1] for e in tune.events)
    off = Autotune(AutotuneConfig(), blocks=1)
    off.observe(0, 1.0)
    off.observe(0, 100.0)
    assert off.events == [] and off.factor == [1.0]


def test_autotunes_checkpointed_state_is_the_step_it_was_taken_at():
    """A checkpoint written in the background serialises the state after the next step has begun: it
    must hold the values of its own step (it held the live lists, so a resume got a later step's)."""
    tune = Autotune(AutotuneConfig(mode="active", plateau_patience=1), blocks=1)
    tune.observe(0, 1.0)
    saved = tune.state_dict()
    tune.observe(0, 1.0)  # the next step: a plateau halves the factor, the EMA moves
    assert saved == {"ema": [1.0], "best": [1.0], "since": [0], "factor": [1.0]} and tune.factor == [0.5]


@pytest.fixture(scope="module")
def distilled(teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("student")
    make_dataset(root)
    doc = _student_doc(root, teacher, autotune={"mode": "monitor"}, verify={"batches": 2})
    doc["model"]["architecture"]["num_key_value_heads"] = 1  # upcycled to MQA: the teacher has 2 KV heads
    cfg = _write(root, "student.json", doc)
    lines = _run(cfg, root)
    return root, cfg, lines


def test_a_distillation_run_goes_through_both_phases_and_records_them(distilled):
    root, _, lines = distilled
    assert any("distillation phase 1: student block 0 learns teacher blocks 0-1" in line for line in lines)
    assert any(line.startswith("step 5/8  distillation phase 2") for line in lines)
    state = json.loads((root / "student" / "training_state.json").read_text())
    assert state["status"] == "finished"
    assert [(e["step"], e["detail"]["phase"], e["detail"]["block"]) for e in state["events"]
            if e["kind"] == "distill"] == [(1, 1, 0), (3, 1, 1), (5, 2, None)]
    assert [(e["step"], e["detail"]["block"], e["detail"]["reason"]) for e in state["events"]
            if e["kind"] == "distill_block"] == [(2, 0, "steps"), (4, 1, "steps")]  # each block's end, its loss
    weights = load_file(str(root / "student" / "checkpoint-step-8.safetensors"))
    assert not any(k.startswith("model.layers.2.") for k in weights)  # a 2-block student
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (8, 32)  # one KV head of 8
    verify = json.loads((root / "student" / "verify.json").read_text())
    assert verify["step"] == 8 and verify["batches"] == 2
    assert [r["what"] for r in verify["rows"]] == ["block 0 output (teacher 0-1)", "block 1 output (teacher 2-3)",
                                                   "logits"]
    assert [e for e in state["events"] if e["kind"] == "verify"][0]["detail"]["rows"] == verify["rows"]
    assert any(line.startswith("  logits: mean L1 ") for line in lines)


def test_apr_verify_compares_a_student_with_its_teacher_and_exits_1_outside_a_threshold(distilled, teacher):
    from typer.testing import CliRunner

    from apr.cli.main import app

    root, _, _ = distilled
    student = root / "student"
    runner = CliRunner()
    wide = runner.invoke(app, ["verify", str(teacher), str(student), "--batches", "2", "--json",
                               "--attention-max-mean-l1", "1e6", "--attention-max-max-l1", "1e6",
                               "--logits-max-mean-l1", "1e6", "--logits-max-max-l1", "1e6"])
    assert wide.exit_code == 0, wide.output
    doc = json.loads(wide.output)
    assert doc["ok"] and doc["batches"] == 2 and doc["tokens"] == 2 * 4 * 16
    logits = doc["rows"][-1]
    assert 0 < logits["mean_l1"] <= logits["max_l1"]
    strict = runner.invoke(app, ["verify", str(teacher), str(student), "--batches", "1",
                                 "--logits-max-max-l1", str(logits["max_l1"] / 2)])
    assert strict.exit_code == 1 and "FAIL" in strict.output and "outside a threshold" in strict.output
    same = runner.invoke(app, ["verify", str(teacher), str(teacher), "--batches", "1", "--data",
                               str(root / "data" / "val")])  # the teacher against itself: all zero
    assert same.exit_code == 0, same.output
    bad = runner.invoke(app, ["verify", str(teacher), str(student), "--logits-max-mean-l1", "0"])
    assert bad.exit_code == 1 and "Traceback" not in bad.output
    assert "--logits-max-mean-l1 must be positive" in bad.output


def test_an_upcycled_gqa_student_exports_to_hugging_face_with_equal_logits(distilled, tmp_path):
    transformers = pytest.importorskip("transformers")
    from apr.checkpoint.export import export_hf
    from apr.data.standin import write_tokenizer
    from apr.generate.load import load_for_inference

    root, _, _ = distilled
    export_hf(root / "student", tmp_path / "hf", tokenizer=write_tokenizer(tmp_path / "tokenizer.json", 61))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.num_key_value_heads == 1
    ours = load_for_inference(root / "student", need_tokenizer=False).model
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_kill_9_in_phase_1_resumes_bitwise(distilled, tmp_path):
    root, cfg, _ = distilled
    make_dataset(tmp_path)
    doc = json.loads(cfg.read_text())
    for key in ("train", "val"):
        doc["data"][key] = doc["data"][key].replace(str(root), str(tmp_path))
    doc["training"]["output_dir"] = str(tmp_path / "student")
    # written before the next step starts, so step 2's checkpoint is complete when step 4 is logged
    doc["training"]["checkpoint_async"] = False
    mine = _write(tmp_path, "student.json", doc)
    _run(mine, tmp_path, kill_at="step 4/8")  # newest checkpoint: step 2 (block 0 done, block 1 not begun)
    _run(mine, tmp_path, resume=True)
    want = load_file(str(root / "student" / "checkpoint-step-8.safetensors"))
    got = load_file(str(tmp_path / "student" / "checkpoint-step-8.safetensors"))
    assert all(got[k].equal(want[k]) for k in want)


def _plan(root: Path, cfg: Path, *args) -> subprocess.CompletedProcess:
    """``python -m apr train plan``, forked from the test worker's server (tests/distributed/ranks.py)."""
    return run_apr(["train", "plan", str(cfg), *args], _env(root), cwd=root)


def test_the_plan_counts_the_teacher_and_both_phases(distilled, teacher):
    root, cfg, _ = distilled
    proc = _plan(root, cfg, "--json", "--gpu", "H100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads(proc.stdout)["facts"]
    d = facts["distill"]
    assert d["teacher"]["layers"] == 4 and d["spans"] == [[0, 2], [2, 4]]
    assert [(p["phase"], p["steps"]) for p in d["phases"]] == [(1, 4), (2, 4)]
    assert facts["memory"]["by_component"]["teacher_weights"] == 4 * d["teacher"]["params"]
    assert d["phases"][0]["flops_per_token"] < d["phases"][1]["flops_per_token"]


def test_distillation_with_the_default_engine_plans_on_autograd_instead_of_refusing(teacher, tmp_path):
    """The interleaved walk cannot form phase 2's full logits: the plan picks the autograd source for
    distillation whatever training.engine says, and says so (issue 39: it used to refuse)."""
    from tests.train.run_helpers import merge

    make_dataset(tmp_path)
    doc = merge(_student_doc(tmp_path, teacher), {"training": {"engine": "interleaved"}})
    proc = _plan(tmp_path, _write(tmp_path, "default-engine.json", doc))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "standard engine (full autograd backward" in proc.stdout


@pytest.mark.parametrize("change, path", [
    ({"model": {"architecture": {"vocab_size": 80}}}, "model.architecture.vocab_size"),
    ({"model": {"architecture": {"hidden_size": 64}}}, "model.architecture.hidden_size"),
    ({"training": {"distill": {"block_map": [[0, 2], [3, 4]]}}}, "training.distill.block_map"),
    ({"training": {"distill": {"phase1_steps": 50}}}, "training.distill.phase1_steps"),
    ({"training": {"distill": {"teacher": "/nonexistent/teacher"}}}, "training.distill.teacher"),
])
def test_incompatible_teacher_and_student_are_refused_at_plan_time(teacher, tmp_path, change, path):
    from tests.train.run_helpers import merge

    make_dataset(tmp_path)
    doc = merge(_student_doc(tmp_path, teacher), change)
    proc = _plan(tmp_path, _write(tmp_path, "bad.json", doc))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert path in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_student_reading_another_tokenizer_than_the_teacher_is_refused(teacher, tmp_path):
    from apr.data.standin import write_tokenizer

    make_dataset(tmp_path)
    beside = write_tokenizer(tmp_path / "teacher-copy" / "tokenizer.json", 61)  # the teacher's own tokenizer
    for f in teacher.glob("checkpoint-*"):  # a copy of the teacher's checkpoints with its tokenizer beside them
        shutil.copy2(f, beside.parent / f.name)
    other = write_tokenizer(tmp_path / "other.json", 61, added_tokens=2)
    doc = _student_doc(tmp_path, beside.parent)
    doc["data"]["tokenizer"] = str(other)
    proc = _plan(tmp_path, _write(tmp_path, "tok.json", doc))
    assert proc.returncode == 1 and "data.tokenizer" in proc.stdout and "teacher" in proc.stdout, proc.stdout
    doc["data"]["tokenizer"] = str(beside)
    assert _plan(tmp_path, _write(tmp_path, "tok.json", doc)).returncode == 0


def test_a_gqa_student_is_planned_beside_its_teacher_and_started_from_averaged_heads(teacher, tmp_path):
    """Upcycling to grouped-query attention: half the teacher's key/value heads. The plan shows both
    architectures' KV cache per token (halved) and refuses a student whose heads do not divide the
    teacher's, naming the key; the built student's key heads are the teacher's averaged in pairs."""
    from apr.plan.build import build_plan
    from apr.train.build import build_engine
    from apr.train.distill import load_teacher
    from tests.train.run_helpers import merge

    make_dataset(tmp_path)
    doc = merge(_student_doc(tmp_path, teacher), {"model": {"architecture": {"num_hidden_layers": 4,
                                                                             "num_key_value_heads": 1}}})
    plan = build_plan(_write(tmp_path, "gqa.json", doc))
    assert not [f for f in plan.findings if f.severity == "error"], plan.findings
    arches = plan.facts["distill"]["architectures"]
    assert arches["teacher"]["kv_cache_bytes_per_token"] == 2 * arches["student"]["kv_cache_bytes_per_token"]
    assert arches["student"]["params"] < arches["teacher"]["params"]
    from apr.plan.render import render_text

    shown = render_text(plan)
    assert "student" in shown and "1 KV heads, KV cache 256 B/token" in shown, shown

    engine = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    t = load_teacher(AprConfig.model_validate(doc), torch.device("cpu"))
    tk, sk = t.model.layers[2].self_attn.k_proj.weight, engine.model.model.layers[2].self_attn.k_proj.weight
    torch.testing.assert_close(sk, (tk[:8] + tk[8:]) / 2)  # head_dim 8: teacher heads 0 and 1 averaged

    bad = merge(doc, {"model": {"architecture": {"num_key_value_heads": 4}}})
    plan = build_plan(_write(tmp_path, "bad.json", bad))
    errors = [f for f in plan.findings if f.severity == "error"]
    assert [f.path for f in errors] == ["model.architecture.num_key_value_heads"], errors


def test_a_block_ends_when_converged_stalled_or_out_of_steps_and_resumes_where_it_was():
    from types import SimpleNamespace

    from apr.train.distill import Progress

    d = SimpleNamespace(convergence_target=0.1, convergence_patience=2, convergence_max_steps=5, phase1_steps=100)
    p = Progress(d, blocks=3)
    assert [p.observe(x) for x in (0.5, 0.3, 0.09)] == [None, None, "converged"]
    p.next_block()
    assert [p.observe(x) for x in (0.5, 0.6, 0.7)] == [None, None, "stalled"]  # 2 steps without a new best
    p.next_block()
    assert [p.observe(x) for x in (0.9, 0.8, 0.7, 0.6)] == [None] * 4
    saved = p.state_dict()
    again = Progress(d, blocks=3)
    again.load_state_dict(saved)
    assert again.observe(0.5) == "max_steps" and again.block == 2  # the fifth step of block 2
    again.next_block()
    assert again.done


def test_convergence_stopping_moves_to_the_next_block_early_and_says_why(teacher, tmp_path):
    """In process, on the engine: a target every step meets ends each block after one step, with an
    event naming the block, its step and final loss; phase 2 follows the last block. The l1 block
    loss is the mean absolute difference."""
    from apr.train.build import build_engine

    make_dataset(tmp_path)
    doc = _student_doc(tmp_path, teacher, block_loss="l1", convergence_target=1e6, phase1_steps=50)
    engine = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    batch = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(1))
    phases = []
    for step in (1, 2, 3):
        engine.current_step = step
        engine.train_step([batch], 1e-3)
        phases.append((engine.loss.last_phase, engine.loss.started))
    assert phases == [((1, 0), True), ((1, 1), True), ((2, None), True)]
    ended = [detail for kind, _, detail in engine.loss.events if kind == "distill_block"]
    assert [(e["block"], e["step"], e["reason"]) for e in ended] == [(0, 1, "converged"), (1, 2, "converged")]
    assert "student block 0 converged (loss <= 1e+06) at step 1" in engine.loss.events[0][1]
    ids = batch[:, :16]
    with torch.no_grad():
        got = engine.loss.block_loss_of(engine, engine.model, 0, ids)
        t = engine.loss.teacher
        cos, sin = t.rope(16, ids.device)
        x = t.model.embed_tokens(ids)
        h = t.model.layers[1](t.model.layers[0](x, cos, sin), cos, sin)
        out = engine.model.model.layers[0](x, *engine.model.rope(16, ids.device))
    torch.testing.assert_close(got, (out - h).abs().mean())

    from apr.plan.build import build_plan
    from apr.plan.render import render_text

    doc["training"]["distill"] = {"teacher": str(teacher), "convergence_target": 0.5, "convergence_max_steps": 2}
    plan = build_plan(_write(tmp_path, "converging.json", doc))
    assert not [f for f in plan.findings if f.severity == "error"], plan.findings
    assert "phase 1: up to 4 steps (mse block loss, each block until converged or stalled, at most 2 steps)" in \
        render_text(plan)
    doc["training"]["distill"] = {"teacher": str(teacher), "convergence_max_steps": 3}  # a cap on nothing
    plan = build_plan(_write(tmp_path, "cap.json", doc))
    assert [f.path for f in plan.findings if f.severity == "error"] == ["training.distill.convergence_max_steps"]


def test_a_decoupled_attention_student_starts_close_to_its_teacher_and_trains_in_both_phases(teacher, tmp_path):
    """Upcycling to decoupled bottleneck attention (sem 2 + geo 4 of head_dim 8), in process: the
    SVD-initialised student's phase-1 block losses are far below a randomly initialised one's, both
    phases step, and verification reads its attention rows."""
    from apr.evaluate.compare import Thresholds, compare_models
    from tests.train.run_helpers import merge

    make_dataset(tmp_path)
    arch = {"num_hidden_layers": 4, "decoupled_attention": {"sem_dim": 2, "geo_dim": 4}}
    doc = merge(_student_doc(tmp_path, teacher, phase1_steps=1), {"model": {"architecture": arch}})
    engine, ids = _starts_close_and_steps(doc)
    result = compare_models(engine.loss.teacher, engine.model, [ids], Thresholds())
    assert [r.what for r in result.rows][:2] == ["block 0 attention", "block 1 attention"]


def test_the_caramba_upcycle_of_a_llama3_shaped_teacher_folder_starts_close_and_trains(tmp_path):
    """The caramba recipe on a Llama-3-shaped teacher: a Hugging Face folder (llama3 RoPE scaling,
    tied embeddings; tiny random weights transformers builds here) upcycled to decoupled attention
    with the teacher's rope_scaling. The student's phase-1 block losses start far below a random
    one's and both phases step."""
    transformers = pytest.importorskip("transformers")
    from tests.train.run_helpers import merge

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8}
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=61, max_position_embeddings=16,
                                   tie_word_embeddings=True, rope_parameters={"rope_theta": 500000.0, **llama3})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama3", safe_serialization=True)
    make_dataset(tmp_path)
    arch = {"num_hidden_layers": 4, "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
            "rope_scaling": llama3, "decoupled_attention": {"sem_dim": 2, "geo_dim": 4}}
    doc = merge(_student_doc(tmp_path, tmp_path / "llama3", phase1_steps=1), {"model": {"architecture": arch}})
    _starts_close_and_steps(doc)


def _starts_close_and_steps(doc: dict):
    """The warm student's four block losses start below a fifth of a random one's, and it steps in
    phase 1 (block 0) and phase 2; the engine and the rows compared."""
    engine, cold, ids = _warm_and_cold(doc)
    for block in range(4):
        warm = engine.loss.block_loss_of(engine, engine.model, block, ids).item()
        assert warm < 0.2 * cold.loss.block_loss_of(cold, cold.model, block, ids).item()
    batch = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(1))
    for step in (1, 5):
        engine.current_step = step
        assert torch.isfinite(engine.train_step([batch], 1e-3).loss)
    return engine, ids


def _narrow_doc(root: Path, teacher: Path) -> dict:
    """A student half the teacher's width (hidden 32 -> 16, head_dim 8 -> 4), 2 blocks of 2."""
    from tests.train.run_helpers import merge

    return merge(_student_doc(root, teacher), {"model": {"architecture": {"hidden_size": 16}}})


def test_a_narrower_student_starts_from_its_teacher_and_trains_its_projections_in_phase_1(teacher, tmp_path):
    """In process: the plan counts the projections; the student initialised through the teacher
    embedding's top directions has phase-1 block losses below a random student's (this teacher,
    trained 6 steps, is nearly isotropic: tests/model/test_surgery.py shows the init exact or far
    closer than random on a teacher whose states fill the kept directions); a phase-1
    step updates the block in training and both projections, a phase-2 step the student and not
    the projections."""
    from apr.plan.build import build_plan
    from apr.train.distill import PROJ_DOWN, PROJ_UP

    make_dataset(tmp_path)
    doc = _narrow_doc(tmp_path, teacher)
    plan = build_plan(_write(tmp_path, "narrow.json", doc))
    assert not [f for f in plan.findings if f.severity == "error"], plan.findings
    assert plan.facts["distill"]["projection_params"] == 2 * 16 * 32
    engine, cold, ids = _warm_and_cold(doc)
    for block in range(2):
        warm = engine.loss.block_loss_of(engine, engine.model, block, ids).item()
        assert warm < 0.8 * cold.loss.block_loss_of(cold, cold.model, block, ids).item()
    proj = engine.loss.projections
    assert proj[PROJ_DOWN].shape == (16, 32) and proj[PROJ_UP].shape == (32, 16)
    batch = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(1))
    for step, moved in ((3, {"model.layers.1.", PROJ_DOWN, PROJ_UP}), (5, {"model.", "lm_head"})):
        before = {k: v.detach().clone() for k, v in engine.gradients.named.items()}
        engine.current_step = step  # phase 1 block 1, then phase 2
        assert torch.isfinite(engine.train_step([batch], 1e-2).loss)
        changed = {k for k, v in engine.gradients.named.items() if not v.equal(before[k])}
        assert changed and all(k.startswith(tuple(moved)) for k in changed), (step, changed)
        assert ({PROJ_DOWN, PROJ_UP} <= changed) == (step == 3), (step, changed)
    from apr.evaluate.compare import Thresholds, compare_models

    alone = compare_models(engine.loss.teacher, engine.model, [ids], Thresholds())  # no projections: logits only
    assert [r.what for r in alone.rows] == ["logits"]


def test_a_narrower_student_trains_resumes_bitwise_and_exports_without_its_projections(teacher, tmp_path):
    """Through the run: both phases, a checkpoint holding the projections and their moments (listed in
    its JSON, and in the plan's checkpoint size), a resume from step 4 equal bitwise at step 8, and a
    Hugging Face export of the narrow student alone with the logits apr computes."""
    from apr.train.distill import PROJ_DOWN

    make_dataset(tmp_path)
    doc = _narrow_doc(tmp_path, teacher)
    doc["training"]["checkpoint_async"] = False
    doc["training"]["distill"]["verify"] = {"batches": 1}  # blocks compared through the projections
    _run(_write(tmp_path, "narrow.json", doc), tmp_path)
    out = tmp_path / "student"
    full = load_file(str(out / "checkpoint-step-8.safetensors"))
    assert {PROJ_DOWN, "optimizer.m." + PROJ_DOWN} <= set(full) and full["model.embed_tokens.weight"].shape[1] == 16
    assert json.loads((out / "checkpoint-step-8.json").read_text())["loss_tensors"][PROJ_DOWN] == [16, 32]
    from apr.plan.build import build_plan

    planned = build_plan(tmp_path / "narrow.json").facts["storage"]["weights_bytes"]
    assert planned == (out / "checkpoint-step-8.safetensors").stat().st_size  # the plan counts them too
    rows = json.loads((out / "verify.json").read_text())["rows"]
    assert [r["what"] for r in rows][:2] == ["block 0 output (teacher 0-1)", "block 1 output (teacher 2-3)"]

    again = tmp_path / "again"
    doc["training"]["output_dir"] = str(again / "student")
    (again / "student").mkdir(parents=True)
    for f in out.glob("checkpoint-step-4.*"):
        shutil.copy2(f, again / "student" / f.name)
    _run(_write(again, "narrow.json", doc), again, resume=True)
    got = load_file(str(again / "student" / "checkpoint-step-8.safetensors"))
    assert set(got) == set(full) and all(got[k].equal(full[k]) for k in full)

    transformers = pytest.importorskip("transformers")
    from apr.checkpoint.export import export_hf
    from apr.data.standin import write_tokenizer
    from apr.generate.load import load_for_inference

    export_hf(out, tmp_path / "hf", tokenizer=write_tokenizer(tmp_path / "tokenizer.json", 61))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.hidden_size == 16
    ours = load_for_inference(out, need_tokenizer=False).model
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def _warm_and_cold(doc: dict):
    """The student engine started from its teacher, the same student started at random, and ids."""
    from apr.train.build import build_engine
    from tests.train.run_helpers import merge

    engine = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    cold_doc = merge(doc, {"training": {"distill": {"init_from_teacher": False}}})
    cold = build_engine(plan_of(AprConfig.model_validate(cold_doc)), "cpu")
    return engine, cold, torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
