"""kill -9 at any moment of an orchestrated, a progressively stacked and a distilled run
(``apr train apply``, the CLI itself, in a process of its own: tests/train/kill_worker.py): the
folder a kill leaves is always continued by ``apply --resume latest`` (a complete checkpoint is
there) or, where none was completed, by a plain ``apply`` (``--resume latest`` refuses, without a
traceback), and the run ends bitwise where the uninterrupted run ends: weights and optimizer moments
of its last checkpoint.

The moments, each run killed at several in turn (the continuing process killed again): ones named
by what the run does (between an orchestrator's branches, just after its decision, inside a
stacking grow, at a distillation phase's first step), by the file being written (inside the first
checkpoint's JSON write, a checkpoint's weights renamed into place without their JSON, a trunk or
teacher cache row or header half written), and seeded ones among all the changes the run makes.
Then what an orchestrated run holds between decisions (a nowcast's history, a safety rollback's
target, a step checkpointed before its safety test) and the events a resumed run records (each once)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from apr.checkpoint.manager import scan
from apr.track import store
from tests.train.run_helpers import config_doc, make_dataset, run_until

WORKER = Path(__file__).resolve().parent / "kill_worker.py"

STALL = {"stall": {"lr_factor": 1.0e-4}}
MODES = {
    # decisions after steps 4 and 8 (branches: steps 5-6 and 9; the run's last step stays a loop step)
    "orchestrated": {"training": {"max_steps": 10, "save_interval": 2, "eval_interval": 4, "orchestrator": {
        "enabled": True, "decision_interval": 4, "eval_horizon": 2, "branches": 2, "strategies": STALL,
        "candidates": ["conservative_adamw", "stall"], "max_loss_increase": None}}},
    # 2 blocks for steps 1-4, then 4 (the first two frozen, their activations cached in the run folder)
    "stacked": {"model": {"architecture": {"num_hidden_layers": 4}, "stacking": {
        "stages": [{"blocks": 2, "steps": 4}, {"blocks": 4}], "init": "copy_top", "earlier": "freeze",
        "freeze_embedding": True, "cache_activations": True}},
        "training": {"max_steps": 8, "save_interval": 2, "eval_interval": 4}},
    # phase 1: student block 0 learns teacher blocks 0-1 (steps 1-2), block 1 blocks 2-3 (3-4); phase 2: 5-8
    "distilled": {"training": {"mode": "distill", "engine": "standard", "max_steps": 8, "save_interval": 2,
                               "eval_interval": 4, "distill": {"phase1_steps": 2, "cache_teacher_outputs": True}}},
    # nowcasting: a line through the weights at the decision points 4 and 8, 6 steps ahead (kept)
    # (checkpoints written before the next step: step 8's is complete when the decision after it starts)
    "nowcast": {"training": {"max_steps": 12, "save_interval": 2, "eval_interval": 4, "checkpoint_async": False,
                             "orchestrator": {
        "enabled": True, "decision_interval": 4, "eval_horizon": 3, "branches": 2, "strategies": STALL,
        "candidates": ["conservative_adamw", "stall"], "max_loss_increase": None,
        "nowcasting": {"enabled": True, "history": 2, "ahead": 6}}}},
    # a strategy that spikes the loss: the safety rollback to the last decision's state (step 5), at step 8
    "safety": {"training": {"max_steps": 14, "save_interval": 2, "eval_interval": 4, "orchestrator": {
        "enabled": True, "decision_interval": 4, "eval_horizon": 1, "candidates": ["boom"],
        "strategies": {"boom": {"lr_factor": 30.0, "clip_mode": "off"}}, "max_loss_increase": 1.5}}},
}
# the same, each checkpoint written before the next step: step 8's is complete when its safety test starts
MODES["safety_sync"] = {"training": {**MODES["safety"]["training"], "checkpoint_async": False}}
LAST = {"orchestrated": 10, "stacked": 8, "distilled": 8, "nowcast": 12, "safety": 14, "safety_sync": 14}


def _env(root: Path, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "APR_HOME": str(root / "home"),
            "APR_TEST_ROOT": str(root), **extra}


def _config(root: Path, mode: str, teacher: Path | None) -> Path:
    from apr.plan.examples import to_yaml

    make_dataset(root)
    doc = config_doc(root, **MODES[mode])
    doc["training"]["log_interval"] = 1
    if mode == "distilled":
        doc["training"]["distill"]["teacher"] = str(teacher)
    path = root / "cfg.yaml"
    path.write_text(to_yaml(doc))
    return path


def _apply(cfg: Path, root: Path, *args: str, **env: str) -> tuple[int, str]:
    code, seen = run_until([sys.executable, str(WORKER), "train", "apply", str(cfg), *args], _env(root, **env),
                           timeout=120)
    return code, "".join(seen)


def _final(root: Path, mode: str) -> dict:
    return load_file(str(root / "run" / f"checkpoint-step-{LAST[mode]}.safetensors"))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A 4-block model trained for two steps: the distilled runs' teacher."""
    root = tmp_path_factory.mktemp("teacher")
    make_dataset(root)
    doc = config_doc(root, model={"architecture": {"num_hidden_layers": 4}},
                     training={"max_steps": 2, "save_interval": 2, "eval_interval": 2})
    path = root / "teacher.json"
    path.write_text(json.dumps(doc))
    code, out = run_until([sys.executable, str(Path(__file__).parent / "run_worker.py"), str(path)],
                          {**os.environ, "OMP_NUM_THREADS": "1", "APR_HOME": str(root / "home")})
    assert code == 0, out[-20:]
    return root / "run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, teacher):
    """Each mode's uninterrupted run: its final checkpoint, the changes it made (in order), its events."""
    refs = {}

    def of(mode: str):
        if mode not in refs:
            root = tmp_path_factory.mktemp(mode)
            log = root / "changes.log"
            code, out = _apply(_config(root, mode, teacher), root, APR_TEST_FS_LOG=str(log))
            assert code == 0, out[-3000:]
            changes = [line.split(" ", 2) for line in log.read_text().splitlines()]
            refs[mode] = (_final(root, mode), [(kind, path) for _, kind, path in changes], _events(root))
        return refs[mode]

    return of


def _continue(cfg: Path, root: Path, **trap: str) -> int:
    """Continue the folder a kill left the way the folder says: ``--resume latest`` where a complete
    checkpoint is; else a plain apply, after ``--resume latest`` refused without a traceback. With
    ``trap`` set, the exit code of that run (it may die again); without, it must finish."""
    complete = [e.step for e in scan(root / "run") if e.complete] if (root / "run").is_dir() else []
    if not complete:
        code, out = _apply(cfg, root, "--resume", "latest")
        assert code == 1 and "Traceback" not in out, f"--resume latest with no complete checkpoint: {out[-3000:]}"
    code, out = _apply(cfg, root, *(["--resume", "latest"] if complete else []), **trap)
    assert code in ((0, -signal.SIGKILL) if trap else (0,)), \
        f"{'--resume latest' if complete else 'apply'} (complete: {complete}, trap {trap}): {out[-3000:]}"
    return code


def _events(root: Path) -> list[tuple[str, int]]:
    """The run's events as training_state.json records them: (kind, step), in order."""
    state = json.loads((root / "run" / "training_state.json").read_text())
    return [(e["kind"], e["step"]) for e in state["events"]]


def _assert_bitwise(root: Path, mode: str, want: dict) -> None:
    got = _final(root, mode)
    assert set(got) == set(want)
    differ = [k for k in want if not got[k].equal(want[k])]
    assert not differ, f"{len(differ)} tensors differ from the uninterrupted run's: {differ[:4]}"
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "finished"


# Each mode's moments, in the order the run reaches them: the run is killed at the first, the folder
# continued and killed again at the next (in the continuing process: its own calls and changes),
# and so on, then continued to its end. APR_TEST_KILL_AT is a file-system change (KIND[*K][+]:REGEX
# over its path), KILL_IN a call (tests/train/kill_worker.py).
MOMENTS = {
    "orchestrated": [
        {"APR_TEST_KILL_AT": r"replace:/\.checkpoint-step-2\.json\."},  # the first checkpoint's JSON, half written
        {"APR_TEST_KILL_IN": "apr.train.orchestrator:Orchestrator._train_branch:2:enter"},  # between the branches
        {"APR_TEST_KILL_IN": "apr.train.orchestrator:Orchestrator._decide:1:exit"},  # just decided
        {"APR_TEST_KILL_AT": r"open:/\.checkpoint-step-8\.json\."},  # the decision step's weights, no JSON
    ],
    "stacked": [
        {"APR_TEST_KILL_IN": "apr.train.stacking:grown_tensors:1:enter"},  # inside the grow
        {"APR_TEST_KILL_IN": "apr.train.run:grow:1:exit"},  # grown, its first step not taken
        {"APR_TEST_KILL_AT": r"open+:/trunk-cache/.*\.tmp\d+\.npy$"},  # a trunk cache row's temp file, empty
        {"APR_TEST_KILL_AT": r"replace:/\.checkpoint-step-6\.json\."},  # the first 4-block JSON, half written
    ],
    "distilled": [
        {"APR_TEST_KILL_AT": r"open+:/teacher/[0-9a-f]+\.json$"},  # the teacher cache's header, still empty
        {"APR_TEST_KILL_AT": r"open*3:/teacher/[0-9a-f]+\.idx$"},  # a cached row, its index entry not
        {"APR_TEST_KILL_AT": r"open:/\.checkpoint-step-4\.json\."},  # phase 1's end: weights, no JSON
        {"APR_TEST_KILL_IN": "apr.train.events:distill_records:2:enter"},  # phase 2's first step (resumed at 4)
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MOMENTS))
def test_kill_9_at_each_named_moment_in_turn_is_continued_and_ends_bitwise(mode, reference, teacher, tmp_path):
    want, *_ = reference(mode)
    cfg = _config(tmp_path, mode, teacher)
    code, out = _apply(cfg, tmp_path, **MOMENTS[mode][0])
    assert code == -signal.SIGKILL, f"the first trap never fired (exit {code}): {out[-2000:]}"
    for trap in MOMENTS[mode][1:]:
        assert _continue(cfg, tmp_path, **trap) == -signal.SIGKILL, f"the trap {trap} never fired"
    _continue(cfg, tmp_path)
    _assert_bitwise(tmp_path, mode, want)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "seed"), [("orchestrated", 1), ("stacked", 2), ("distilled", 3)])
def test_kill_9_at_seeded_moments_is_continued_and_ends_bitwise(mode, seed, reference, teacher, tmp_path):
    """Killed just before a seeded one of the changes the uninterrupted run makes (whatever the run
    is doing then: any of its writes, in the main thread or the background checkpoint writer's),
    then again in the process that continues, then continued to the end."""
    import random

    want, changes, _ = reference(mode)
    rng = random.Random(seed)
    cfg = _config(tmp_path, mode, teacher)
    code, out = _apply(cfg, tmp_path, APR_TEST_KILL_AT=str(rng.randint(1, len(changes))))
    assert code == -signal.SIGKILL, out[-2000:]
    if _continue(cfg, tmp_path, APR_TEST_KILL_AT=str(rng.randint(1, len(changes) // 2))) != 0:
        _continue(cfg, tmp_path)
    _assert_bitwise(tmp_path, mode, want)


# What an orchestrated run keeps between decisions is in its checkpoints (or the run folder), so a
# process that resumes there decides as the uninterrupted one does.
@pytest.mark.slow
def test_kill_9_between_the_decisions_of_a_nowcasting_run_ends_bitwise(reference, teacher, tmp_path):
    """The nowcast at step 8 extrapolates over the weights at steps 4 and 8: the resumed process reads
    step 4's back from the run folder (.apr/nowcast/), keeps the nowcast and ends where the run ends."""
    want, *_ = reference("nowcast")
    cfg = _config(tmp_path, "nowcast", teacher)
    # the second decision begins: step 8's checkpoint (written before it) is the newest
    code, out = _apply(cfg, tmp_path, APR_TEST_KILL_IN="apr.train.orchestrator:Orchestrator._decide:2:enter")
    assert code == -signal.SIGKILL, out[-2000:]
    _continue(cfg, tmp_path)
    _assert_bitwise(tmp_path, "nowcast", want)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["safety", "safety_sync"])
def test_kill_9_before_a_safety_rollback_ends_bitwise(mode, reference, teacher, tmp_path):
    """Killed as the spike at step 8 is to be rolled back: the resumed process rolls back to step 5
    (the decision's kept state, checkpointed by the decision), from step 6's checkpoint (step 8's in
    flight) or from step 8's (written before the safety test: the checkpoint holds the step's loss)."""
    want, *_ = reference(mode)
    cfg = _config(tmp_path, mode, teacher)
    code, out = _apply(cfg, tmp_path, APR_TEST_KILL_IN="apr.train.orchestrator:Orchestrator._safety_rollback:1:enter")
    assert code == -signal.SIGKILL, out[-2000:]
    if mode == "safety_sync":
        assert max(e.step for e in scan(tmp_path / "run") if e.complete) == 8
    _continue(cfg, tmp_path)
    _assert_bitwise(tmp_path, mode, want)
    assert [kind for kind, _ in _events(tmp_path)].count("safety_rollback") == 1


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "trap"), [
    ("stacked", r"open:/\.checkpoint-step-6\.safetensors\."),  # the grow at step 5 recorded; resumed from step 4
    ("orchestrated", r"open:/\.checkpoint-step-8\.safetensors\."),  # resumed from 4: decided after its checkpoint
])
def test_a_resumed_run_records_each_event_once(mode, trap, reference, teacher, tmp_path):
    _, _, events = reference(mode)
    cfg = _config(tmp_path, mode, teacher)
    code, out = _apply(cfg, tmp_path, APR_TEST_KILL_AT=trap)
    assert code == -signal.SIGKILL, out[-2000:]
    _continue(cfg, tmp_path)
    assert _events(tmp_path) == events
    run_id = json.loads((tmp_path / "run" / "training_state.json").read_text())["run_id"]
    for db in (tmp_path / "run" / ".apr" / "experiments.db", tmp_path / "home" / "experiments.db"):  # both stores
        with contextlib.closing(store.connect_readonly(db)) as conn:
            assert [(e["kind"], e["step"]) for e in store.events(conn, run_id)] == events, db
