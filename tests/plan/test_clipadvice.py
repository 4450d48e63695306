"""The plan says what exact global clipping costs with one gradient workspace, and what would cost
less (issue 40 item 4: 0.85x a plain loop is out of reach for any exact schedule at that memory)."""

from __future__ import annotations

from apr.plan.build import build_plan
from tests.train.run_helpers import make_dataset, write_config


def _plan(tmp_path, name, **training):
    return build_plan(write_config(tmp_path, name, training={"grad_clip": 1.0, **training}))


def test_lean_exact_clipping_is_explained_with_its_bound_and_the_alternatives(tmp_path):
    make_dataset(tmp_path)
    lean = _plan(tmp_path, "lean.yaml", clip_mode="global",
                 execution={"activations": "selective", "gradients": "workspace"})
    (note,) = [f for f in lean.findings if f.code == "plan.exact_clip_cost"]
    assert note.severity == "info" and note.path == "training.clip_mode" and note.line is not None
    assert "6.25F a step against a plain loop's 3F (0.48x" in note.message
    assert "costs less than 5F (0.60x, activations keep)" in note.message
    assert "gradients: kept" in note.message and "clip_mode: adagc or per_block" in note.message
    for quiet in (_plan(tmp_path, "kept.yaml", clip_mode="global", execution={"gradients": "kept"}),
                  _plan(tmp_path, "adagc.yaml", clip_mode="adagc",
                        execution={"activations": "selective", "gradients": "workspace"})):
        assert not [f for f in quiet.findings if f.code == "plan.exact_clip_cost"]
