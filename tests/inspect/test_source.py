"""What `apr inspect` opens: apr checkpoints without their optimizer state, run directories, Hugging
Face folders, bare .safetensors files; anything else refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from apr.inspect.source import NotACheckpoint, open_weights  # noqa: E402


def test_checkpoint_run_and_hf_folder_hold_the_same_weights(untrained_lm):
    ckpt, run, hf = (open_weights(p) for p in (untrained_lm.checkpoint, untrained_lm.run_dir, untrained_lm.hf_dir))
    assert (ckpt.kind, run.kind, hf.kind) == ("checkpoint", "run", "hf") and run.step == untrained_lm.steps
    assert not any(n.startswith("optimizer.") for n in ckpt.names)  # AdamW moments are not weights
    assert sorted(ckpt.names) == sorted(hf.names)
    name = "model.layers.1.mlp.down_proj.weight"
    assert ckpt.shape(name) == hf.shape(name) and bool((ckpt.rows(name, 0, 3) == hf.rows(name, 0, 3)).all())


@pytest.mark.parametrize("make, why", [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt", "a .txt file"),
    (lambda p: (p / "w.safetensors").write_bytes(b"\x08garbage") and p / "w.safetensors", "cannot be read"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no checkpoint-step"),
    (lambda p: (p / "checkpoint-step-1.json").write_text("{}") and p / "checkpoint-step-1.json", "not an apr"),
])
def test_not_a_checkpoint_is_refused_with_the_reason(tmp_path, make, why):
    with pytest.raises(NotACheckpoint) as err:
        open_weights(make(tmp_path))
    assert why in err.value.message and err.value.findings[0].code == "inspect.not_a_checkpoint"
