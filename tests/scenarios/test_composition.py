"""The composition table (docs/design.md, "The composed engine"): features that the sharded
layout used to refuse, run on FSDP2 shards (2 gloo ranks, full sharding) and compared with one
process reading twice the micro-batch, as tests/distributed/test_sharding.py compares plain
pretraining. One cell per feature; each names its bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apr.checkpoint.manager import read_checkpoint
from tests.distributed.test_sharding import _launch, _rel, _weights
from tests.evaluate.test_during_training import counting_task, word_tokenizer
from tests.train.run_helpers import config_doc, make_dataset

OPT = {"lr": 3e-3, "min_lr": 3e-4}


def _pair(root: Path, name: str, batch: int = 2, sharding: str = "full", shards: Path | None = None,
          **sections) -> tuple[Path, Path]:
    """The same config as one process (micro-batch 2 x batch) and as 2 ranks (batch each) under
    ``sharding`` (``hybrid``: two one-rank "nodes", as tests/distributed/test_sharding.py simulates
    them; ``none``: plain data parallelism); returns both run folders. The one-process run does not
    depend on the layout: the cells of one feature share it (on one test worker)."""
    training = sections.pop("training", {})
    data = sections.pop("data", {})
    one = config_doc(root, data={**data, "batch_size": 2 * batch}, optimizer=OPT,
                     training={**training, "output_dir": f"{name}-one/"}, **sections)
    layout = {"sharding": sharding, **({"nodes": 2} if sharding == "hybrid" else {})}  # none: DDP
    two = config_doc(root, data={**data, "batch_size": batch}, optimizer=OPT,
                     training={**training, "output_dir": f"{name}-{sharding}/", **layout}, **sections)
    done = root / f"{name}-one.json"
    if not (done.is_file() and json.loads(done.read_text()) == one and (root / f"{name}-one").is_dir()):
        _launch(one, done, 1)
    _launch(two, root / f"{name}-{sharding}.json", 2, shards=shards,
            extra_env={"APR_SHARD_GROUP_SIZE": "1"} if sharding == "hybrid" else None)
    return root / f"{name}-one", root / f"{name}-{sharding}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The pattern data, a word tokenizer and a counting task, and a 4-block model trained on the data
    for 6 steps (``base/``: LoRA's base and distillation's teacher)."""
    root = tmp_path_factory.mktemp("composition")
    make_dataset(root, train_rows=160)
    word_tokenizer(root / "tok.json")
    counting_task(root / "count.jsonl")
    base = config_doc(root, model={"architecture": {"num_hidden_layers": 4}},
                      training={"max_steps": 6, "save_interval": 6, "eval_interval": 0, "output_dir": "base/"})
    _launch(base, root / "base.json", 1)
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "sharding"), [("interleaved", "full"), ("standard", "full"),
                                                  ("interleaved", "hybrid"), ("interleaved", "none")])
def test_lora_with_in_training_samples_and_tasks_on_shards_equals_one_process(root, engine, sharding):
    """Only the adapters train and are checkpointed, alike on shards (each rank's rows of each adapter)
    and in one process; in-training task scores and samples run on every rank (the whole weights
    gathered) and rank 0 records them."""
    one, two = _pair(
        root, f"lora-{engine}", sharding=sharding, shards=root / f"lora-{engine}-{sharding}.shards",
        model={"architecture": {"num_hidden_layers": 4}, "init_from": str(root / "base"),
               "lora": {"rank": 4, "alpha": 8.0, "targets": "all"}},
        data={"tokenizer": str(root / "tok.json")},
        evaluation={"tasks": [str(root / "count.jsonl")], "interval": 4,
                    "samples": {"prompts": ["1 2 3"], "max_new_tokens": 3}},
        training={"max_steps": 8, "save_interval": 8, "eval_interval": 4, "engine": engine, "grad_clip": 0.5})
    got, want = _weights(two, 8), _weights(one, 8)
    assert set(got) == set(want) and all("lora_" in k for k in got)  # adapters (and their moments) only
    # lora_B starts at zero, so after 8 steps its norm is small and the half-batch sums' rounding is
    # relatively larger (measured 1.1e-6 on k_proj's B; every other tensor within 6e-7): bound 1e-5
    assert _rel(got, want) <= 1e-5
    state, ref = (json.loads((d / "training_state.json").read_text()) for d in (two, one))
    assert state["status"] == "finished"
    assert state["evals"]["count"]["acc"] == ref["evals"]["count"]["acc"]
    assert state["samples"]["items"] == ref["samples"]["items"]
    assert read_checkpoint(two / "checkpoint-step-8.json").meta["engine"]["base"]["init_from"] == str(root / "base")
    if sharding != "none":  # the plan's frozen base per rank is the rows FSDP2 gave rank 0
        _frozen_rows_are_planned(root / f"lora-{engine}-{sharding}.shards", two)


def _frozen_rows_are_planned(shards: Path, run: Path) -> None:
    from apr.config.schema import AprConfig
    from apr.memory.buffers import buffer_plan

    doc = json.loads((run.parent / f"{run.name}.json").read_text())
    config = AprConfig.model_validate({**doc, "training": {**doc["training"], "world_size": 2}})
    planned = sum(b.nbytes for b in buffer_plan(config) if b.component == "frozen_weights")
    assert json.loads(shards.read_text())["frozen_bytes"] == planned


@pytest.mark.slow
def test_a_bf16_lora_trunk_on_shards_trains_as_data_parallel(root):
    """``model.lora.trunk_dtype: bf16`` under FSDP2: the frozen bf16 projections and the float32
    adapters share a unit (FSDP2 gathers mixed dtypes as bytes; only trainable parameters must share
    a dtype). The reference is plain data parallelism on the same 2 ranks and rows. Under bf16
    autocast a float32 difference of one rounding (the shards' reduce-scatter against DDP's
    all-reduce) flips some bf16 roundings of the activations, and the runs drift apart at bf16's
    resolution: measured 8.6e-3 on the adapters after 8 steps (one process against DDP: 1.5e-2),
    bound 3e-2; the losses, which average that noise out, agree within 2.4e-5 (bound 1e-4)."""
    runs = {}
    for sharding in ("none", "full", "hybrid"):
        doc = config_doc(
            root, data={"tokenizer": str(root / "tok.json"), "batch_size": 2}, optimizer=OPT,
            model={"architecture": {"num_hidden_layers": 4}, "init_from": str(root / "base"),
                   "lora": {"rank": 4, "alpha": 8.0, "targets": "all", "trunk_dtype": "bf16"}},
            evaluation={"tasks": [str(root / "count.jsonl")], "interval": 4,
                        "samples": {"prompts": ["1 2 3"], "max_new_tokens": 3}},
            training={"max_steps": 8, "save_interval": 8, "eval_interval": 4, "engine": "interleaved",
                      "mixed_precision": "bf16", "grad_clip": 0.5, "sharding": sharding,
                      "output_dir": f"bf16-trunk-{sharding}/", **({"nodes": 2} if sharding == "hybrid" else {})})
        _launch(doc, root / f"bf16-trunk-{sharding}.json", 2, shards=root / f"bf16-trunk-{sharding}.shards",
                extra_env={"APR_SHARD_GROUP_SIZE": "1"} if sharding == "hybrid" else None)
        runs[sharding] = root / f"bf16-trunk-{sharding}"
    _frozen_rows_are_planned(root / "bf16-trunk-full.shards", runs["full"])
    want = _weights(runs["none"], 8)
    ref = json.loads((runs["none"] / "training_state.json").read_text())
    for sharding in ("full", "hybrid"):
        got = _weights(runs[sharding], 8)
        assert set(got) == set(want) and all("lora_" in k for k in got)  # the adapters, in each rank's rows
        assert _rel(got, want) <= 3e-2, sharding
        state = json.loads((runs[sharding] / "training_state.json").read_text())
        assert state["status"] == "finished" and len(state["loss_history"]) == 4
        for (step, loss), (ref_step, ref_loss) in zip(state["loss_history"], ref["loss_history"], strict=True):
            assert step == ref_step and abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (sharding, step)
        assert state["samples"]["items"] and "acc" in state["evals"]["count"]  # evaluated on the gathered trunk


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_progressive_stacking_grows_and_freezes_on_shards_as_in_one_process(root, sharding):
    """2 -> 4 blocks at step 4, earlier blocks frozen: the grown model is re-sharded from the
    gathered one, the frozen blocks never move, and the end equals one process."""
    one, two = _pair(
        root, "stack", sharding=sharding,
        model={"architecture": {"num_hidden_layers": 4},
               "stacking": {"stages": [{"blocks": 2, "steps": 4}, {"blocks": 4}], "init": "copy_top",
                            "earlier": "freeze"}},
        training={"max_steps": 8, "save_interval": 4, "eval_interval": 4, "engine": "interleaved",
                  "grad_clip": 0.5})
    # at the growth (step 4) within 4.1e-7; the grown blocks' AdamW moments restart there, so 4 steps
    # later they are small and the half-batch sums' rounding is relatively larger (measured 2.3e-6 on a
    # grown block's m): bound 1e-5
    assert _rel(_weights(two, 4), _weights(one, 4)) <= 1e-6
    assert _rel(_weights(two, 8), _weights(one, 8)) <= 1e-5
    at_growth, end = _weights(two, 4), _weights(two, 8)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert (at_growth[name] == end[name]).all(), name  # frozen after the growth


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full", "none", "hybrid"])
def test_blockwise_distillation_on_shards_equals_one_process(root, sharding):
    """Distillation's loss part on the autograd source under FSDP2 (the teacher whole on each rank):
    both phases (phase 1 one student block at a time, then KD) match one process. The configured
    default engine (interleaved) is not refused: distillation runs on autograd. Bound 1e-5: the KD
    loss's softmax over the vocabulary sums in another order on half the batch per rank."""
    one, two = _pair(
        root, "distill", sharding=sharding,
        model={"architecture": {"num_hidden_layers": 2}},
        training={"mode": "distill", "max_steps": 8, "save_interval": 8, "eval_interval": 4,
                  "distill": {"teacher": str(root / "base"), "phase1_steps": 2, "init_from_teacher": True}})
    assert _rel(_weights(two, 8), _weights(one, 8)) <= 1e-5
    meta = read_checkpoint(two / "checkpoint-step-8.json").meta["engine"]
    assert meta["engine"] == "distill" and "autotune" in meta


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full", "hybrid", "none"])
def test_compiled_blocks_on_shards_equal_one_process(root, sharding):
    """``training.execution.compile`` under FSDP2: each block is compiled in place
    (``Module.compile``, no parameter renamed) and dynamo leaves FSDP2's hooks to run eagerly, so
    the sharded walk trains compiled blocks and ends where one compiled process does (measured
    1.2e-6 after 4 steps: bound 1e-5)."""
    one, two = _pair(root, "compile", sharding=sharding,
                     training={"max_steps": 4, "save_interval": 4, "eval_interval": 0, "engine": "interleaved",
                               "execution": {"compile": True}})
    assert _rel(_weights(two, 4), _weights(one, 4)) <= 1e-5
    assert read_checkpoint(two / "checkpoint-step-4.json").meta["engine"]["engine"] == "interleaved"


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_a_mixture_with_adagc_on_shards_equals_one_process(root, sharding):
    """A two-source mixture (the loader deals each global micro-batch's rows to the ranks, so the
    layout does not change what is drawn) with AdaGC's per-tensor clipping on FSDP2 shards: the
    same weights as one process (bound 1e-5, as the other cells), and the same rows per source."""
    from tests.train.test_mixture_run import write_source

    for i, name in enumerate(("web", "code")):
        write_source(root / "mix" / name, 40, seed=20 + i)
    sources = [{"name": "web", "path": str(root / "mix/web/train"), "weight": 0.6},
               {"name": "code", "path": str(root / "mix/code/train"), "weight": 0.4}]
    one, two = _pair(root, "mixture", sharding=sharding, data={"train": sources, "val": None},
                     training={"max_steps": 6, "save_interval": 6, "eval_interval": 0, "engine": "interleaved",
                               "clip_mode": "adagc"})
    assert _rel(_weights(two, 6), _weights(one, 6)) <= 1e-5
    rows = [{n: s["rows"] for n, s in json.loads((d / "training_state.json").read_text())["mixture"]["sources"].items()}
            for d in (two, one)]
    assert rows[0] == rows[1] and rows[0]["web"] > 0 and rows[0]["code"] > 0
