"""The causal-LM loss part goes through the model's one loss entry point: the same number as
``model(ids, targets)``, and evaluation's summed form is the mean times the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apr.steps.resolved import resolve as plan_of
from apr.train import losses
from apr.train.build import build_engine
from apr.train.losses import IGNORE, CausalLM, mask_positions, masked_batch
from tests.train.tiny import batches, make_config


def _cached_decoding_is_the_full_forward(model) -> None:
    """apr generate's KV-cached decoding of a trained checkpoint gives the full forward's logits."""
    from apr.generate.decode import KVCache, forward_cached, forward_full

    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, 2, 9)
    forward_cached(model, ids[:, :5], cache)
    for t in range(5, 9):
        torch.testing.assert_close(forward_cached(model, ids[:, t:t + 1], cache), forward_full(model, ids[:, :t + 1]),
                                   rtol=1e-5, atol=1e-5)


def test_the_loss_part_the_models_forward_and_evaluation_agree():
    engine = build_engine(plan_of(make_config(training={"engine": "standard"})))
    (batch,) = batches(engine.config, 1)
    ids, targets = engine.split(batch)
    part = CausalLM()(engine, engine.model, ids, targets)
    forward = engine.model(ids, targets, loss_chunk_size=engine.chunk_size)
    assert torch.allclose(part, forward, rtol=1e-6, atol=0)
    total, count = engine.eval_loss_sum(batch)
    assert count == targets.numel() and torch.allclose(total / count, part.detach(), rtol=1e-6, atol=0)
    part.backward()  # differentiable: every weight gets a gradient
    assert all(p.grad is not None for p in engine.gradients.named.values())


def _mlm_engine(rate: float = 0.15):
    return build_engine(plan_of(make_config(training={"engine": "standard", "mode": "mlm",
                                                      "mlm": {"mask_rate": rate, "mask_token_id": 52}})))


def test_masked_lm_loss_is_the_cross_entropy_at_the_masked_positions_only(monkeypatch):
    """A hand-made batch and mask: the input holds the mask token at the masked positions, and the
    loss is the mean of the cross-entropy of the model's logits at those two positions only."""
    engine = _mlm_engine()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[False, True, False, False, True, False], [False] * 6])
    inputs, targets = masked_batch(ids, mask, 52)
    assert inputs.tolist() == [[5, 52, 7, 8, 52, 10], [11, 12, 13, 14, 15, 16]]
    assert targets.tolist() == [[IGNORE, 6, IGNORE, IGNORE, 9, IGNORE], [IGNORE] * 6]
    monkeypatch.setattr(losses, "mask_positions", lambda rows, rate, seed, step: mask)
    part = engine.loss(engine, engine.model, ids, ids)
    logits = engine.model(inputs)  # [batch, seq, vocab], the bidirectional model
    by_hand = (F.cross_entropy(logits[0, 1], torch.tensor(6)) + F.cross_entropy(logits[0, 4], torch.tensor(9))) / 2
    assert torch.allclose(part, by_hand, rtol=1e-5, atol=0)
    total, count = engine.loss.eval_loss_sum(engine, torch.cat([ids, ids[:, :1]], dim=1))
    assert count == 2 and torch.allclose(total / 2, by_hand, rtol=1e-5, atol=0)


def test_the_masked_lm_learns_a_fixed_batch():
    engine = _mlm_engine(0.3)
    data = batches(engine.config, 2, seed=4)
    first = float(engine.train_step(data, 1e-2).loss)  # current_step stays 1: the same masks every step
    for _ in range(19):
        last = float(engine.train_step(data, 1e-2).loss)
    assert last < first / 2


def test_the_masking_rate_and_a_rows_mask_depend_on_the_seed_step_and_row_only():
    rows = torch.randint(0, 50, (64, 512), generator=torch.Generator().manual_seed(3))
    mask = mask_positions(rows, 0.15, seed=1, step=4)
    assert abs(mask.float().mean().item() - 0.15) < 0.01
    assert torch.equal(mask_positions(rows[10:12].flip(0), 0.15, seed=1, step=4), mask[10:12].flip(0))
    assert not torch.equal(mask_positions(rows[:4], 0.15, seed=1, step=5), mask[:4])
    assert not torch.equal(mask_positions(rows[:4], 0.15, seed=2, step=4), mask[:4])
    assert abs(mask_positions(rows, 0.4, seed=1, step=4).float().mean().item() - 0.4) < 0.01


def test_the_masked_lm_attends_both_ways_and_the_causal_lm_does_not():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    later = torch.tensor([[1, 2, 3, 4, 5, 7]])  # only the last token differs
    for engine, sees_ahead in ((_mlm_engine(), True),
                               (build_engine(plan_of(make_config(training={"engine": "standard"}))), False)):
        first, other = engine.model(ids)[0, 0], engine.model(later)[0, 0]
        assert (not torch.equal(first, other)) is sees_ahead


def test_an_mlm_run_scores_its_masked_validation_loss_and_resumes_bitwise(tmp_path):
    """apr train apply with training.mode mlm: the validation loss (masked positions, bidirectional)
    starts at about ln(vocab), and a run resumed from its step-4 checkpoint ends with the same bits
    and the same validation loss (each step draws its masks from the step and the rows)."""
    import math

    from run_helpers import VOCAB, make_dataset, resume_elsewhere, write_config

    from apr.apply import run_apply

    make_dataset(tmp_path, train_rows=64, val_rows=8)
    sections = {"training": {"engine": "standard", "mode": "mlm", "mlm": {"mask_rate": 0.25, "mask_token_id": 0},
                             "max_steps": 8, "save_interval": 4, "eval_interval": 4}}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    straight = run_apply(write_config(tmp_path, **sections), **quiet)
    assert straight.final_step == 8 and abs(straight.first_val_loss - math.log(VOCAB)) < 0.5
    resume_elsewhere(tmp_path, sections, straight, 4, 8, quiet)
    from typer.testing import CliRunner

    from apr.cli.main import app

    runner = CliRunner()  # what reads the model left to right refuses it, with the reason
    for args in (["generate", str(tmp_path / "run"), "--prompt", "x"], ["eval", str(tmp_path / "run")],
                 ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 1 and "training.mode: mlm" in r.output and "Traceback" not in r.output, args
    assert not (tmp_path / "hf").exists()


MOE = {"num_experts": 4, "top_k": 2, "balance_loss_coef": 0.5}


def test_the_moe_loss_part_adds_the_blocks_mean_balance_loss_times_its_coefficient():
    """model.architecture.moe: the training loss is the cross-entropy plus coef x the blocks' mean balance
    loss; evaluation's is the cross-entropy alone; the step's figures are the micro-batches' routing."""
    config = make_config(model={"architecture": {"moe": MOE}}, training={"engine": "standard"})
    engine = build_engine(plan_of(config))
    assert isinstance(engine.loss, CausalLM) and engine.loss.routing is not None
    (batch,) = batches(config, 1)
    ids, targets = engine.split(batch)
    engine.loss.begin_step(1)
    part = engine.loss(engine, engine.model, ids, targets)
    blocks = [layer.mlp for layer in engine.model.model.layers]
    balance = sum(b.balance.item() for b in blocks) / len(blocks)
    cross_entropy = engine.model(ids, targets, loss_chunk_size=engine.chunk_size).item()
    assert abs(part.item() - (cross_entropy + 0.5 * balance)) < 1e-5 and balance > 1.0
    total, count = engine.eval_loss_sum(batch)
    assert abs(total.item() / count - cross_entropy) < 1e-5
    figures = engine.loss.routing.metrics()
    assert abs(figures["moe_balance_loss"] - balance) < 1e-6
    load = torch.stack([b.load for b in blocks]).double()
    want = (load / load.sum(dim=1, keepdim=True))
    assert figures["moe_expert_load"] == want.mean(dim=0).tolist() and abs(sum(figures["moe_expert_load"]) - 1) < 1e-9
    assert figures["moe_max_expert_load"] == want.max().item()
    part.backward()  # the router learns from both terms
    assert all(b.gate.weight.grad.abs().sum() > 0 for b in blocks)


def test_an_moe_run_records_its_routing_resumes_bitwise_and_its_checkpoint_decodes_with_the_cache(tmp_path):
    """apr train apply with experts: training_state.json and `apr monitor --json` carry the balance loss
    and each expert's share; a run resumed from its step-4 checkpoint ends with the same bits and
    validation loss; the checkpoint loads for generation, and cached decoding gives the full forward's
    logits."""
    import json

    from run_helpers import make_dataset, resume_elsewhere, write_config
    from typer.testing import CliRunner

    from apr.apply import run_apply
    from apr.cli.main import app
    from apr.generate.load import load_for_inference

    make_dataset(tmp_path, train_rows=64, val_rows=8)
    sections = {"model": {"architecture": {"moe": MOE}},
                "training": {"engine": "standard", "max_steps": 8, "save_interval": 4, "eval_interval": 4}}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    straight = run_apply(write_config(tmp_path, **sections), **quiet)
    assert straight.final_step == 8
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    moe = state["moe"]
    assert moe["step"] == 8 and 1.0 <= moe["moe_balance_loss"] < 4.0 and len(moe["moe_expert_load"]) == 4
    assert abs(sum(moe["moe_expert_load"]) - 1) < 1e-6 and moe["moe_max_expert_load"] >= max(moe["moe_expert_load"])
    shown = json.loads(CliRunner().invoke(app, ["monitor", str(tmp_path / "run"), "--json"]).output)
    assert shown["state"]["moe"] == moe
    resume_elsewhere(tmp_path, sections, straight, 4, 8, quiet)
    model = load_for_inference(tmp_path / "run", need_tokenizer=False).model
    _cached_decoding_is_the_full_forward(model)


@pytest.mark.parametrize("activations", ["selective", "recompute"])
def test_recomputed_expert_blocks_train_the_weights_of_kept_ones_bitwise(activations):
    """An expert block recomputed in the backward (torch.utils.checkpoint) routes its tokens again to
    the same experts: the balance loss's gradient and the weights are those of the kept graph."""
    def train(policy: str) -> dict:
        config = make_config(model={"architecture": {"moe": MOE}},
                             training={"engine": "standard", "execution": {"activations": policy}})
        engine = build_engine(plan_of(config))
        for batch in batches(config, 3, seed=2):
            engine.train_step([batch], lr=1e-2)
        return engine.train_state_tensors()

    got, want = train(activations), train("keep")
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_the_masked_lm_with_experts_adds_the_balance_term_to_its_masked_loss(monkeypatch):
    """training.mode: mlm with model.architecture.moe: the masked positions' cross-entropy plus coef x
    the blocks' mean balance loss; its validation loss is the masked cross-entropy alone."""
    mlm = {"engine": "standard", "mode": "mlm", "mlm": {"mask_rate": 0.15, "mask_token_id": 52}}
    config = make_config(model={"architecture": {"moe": MOE}}, training=mlm)
    engine = build_engine(plan_of(config))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[False, True, False, False, True, False], [False] * 6])
    monkeypatch.setattr(losses, "mask_positions", lambda rows, rate, seed, step: mask)
    part = engine.loss(engine, engine.model, ids, ids)
    balance = sum(layer.mlp.balance.item() for layer in engine.model.model.layers) / 3
    logits = engine.model(masked_batch(ids, mask, 52)[0])
    masked = (F.cross_entropy(logits[0, 1], torch.tensor(6)) + F.cross_entropy(logits[0, 4], torch.tensor(9))) / 2
    assert abs(part.item() - (masked.item() + 0.5 * balance)) < 1e-5
    total, count = engine.loss.eval_loss_sum(engine, torch.cat([ids, ids[:, :1]], dim=1))
    assert count == 2 and abs(total.item() / 2 - masked.item()) < 1e-5


TIME = {"embedding_dim": 8, "num_time_steps": 10, "encoding": "learned", "eval_time": 0.75}


def test_each_training_row_runs_at_its_drawn_time_step_and_validation_at_eval_times():
    """model.architecture.time (interpretation input): the loss part is the model's loss with each row
    at the step drawn from the seed, the step and its tokens; validation runs every row at eval_time's
    step (floor(0.75 x 10) = 7); the time embedding learns."""
    from apr.model.time import conditioned, row_steps

    config = make_config(model={"architecture": {"time": TIME}}, training={"engine": "standard"})
    engine = build_engine(plan_of(config))
    (batch,) = batches(config, 1)
    ids, targets = engine.split(batch)
    engine.loss.begin_step(5)
    part = engine.loss(engine, engine.model, ids, targets)
    drawn = row_steps(ids, 10, config.training.seed, 5)
    with conditioned(engine.model, drawn):
        want = engine.model(ids, targets, loss_chunk_size=engine.chunk_size)
    assert torch.allclose(part, want, rtol=1e-6, atol=0)
    with conditioned(engine.model, torch.full((2,), 7)):
        at_eval = engine.model(ids, targets, loss_chunk_size=engine.chunk_size)
    total, count = engine.eval_loss_sum(batch)
    assert abs(total.item() / count - at_eval.item()) < 1e-5 and abs(at_eval.item() - want.item()) > 1e-6
    part.backward()
    table = engine.model.model.time_embedding.table.weight.grad
    assert [s for s in range(10) if table[s].abs().sum() > 0] == sorted(set(drawn.tolist()))


def test_time_step_masking_masks_each_row_at_its_steps_rate(monkeypatch):
    """masking: true under training.mode mlm: each training row is masked at rate (step + 1) / 10 of its
    drawn step, validation at eval_time's ((7 + 1) / 10)."""
    from apr.model.time import row_steps

    config = make_config(model={"architecture": {"time": {**TIME, "masking": True}}},
                         training={"engine": "standard", "mode": "mlm", "mlm": {"mask_token_id": 52}})
    engine = build_engine(plan_of(config))
    seen, real = [], losses.mask_positions
    monkeypatch.setattr(losses, "mask_positions", lambda rows, rate, seed, step: seen.append(rate) or
                        real(rows, rate, seed, step))
    (batch,) = batches(config, 1)
    ids, targets = engine.split(batch)
    engine.loss.begin_step(3)
    engine.loss(engine, engine.model, ids, targets)
    engine.loss.eval_loss_sum(engine, batch)
    drawn = row_steps(ids, 10, config.training.seed, 3)
    assert seen[0].tolist() == [(s + 1) / 10 for s in drawn.tolist()] and seen[1].tolist() == [0.8, 0.8]


def test_a_time_conditioned_run_resumes_bitwise_and_its_checkpoint_decodes_at_eval_time(tmp_path):
    """apr train apply with a learned time embedding: a run resumed from its step-4 checkpoint ends with
    the same bits and validation loss; the checkpoint loads for generation at eval_time's step, cached
    decoding gives the full forward's logits; apr export refuses it with the reason."""

    from run_helpers import make_dataset, resume_elsewhere, write_config
    from typer.testing import CliRunner

    from apr.apply import run_apply
    from apr.cli.main import app
    from apr.generate.load import load_for_inference

    make_dataset(tmp_path, train_rows=64, val_rows=8)
    sections = {"model": {"architecture": {"time": TIME}},
                "training": {"engine": "standard", "max_steps": 8, "save_interval": 4, "eval_interval": 4}}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    straight = run_apply(write_config(tmp_path, **sections), **quiet)
    final = resume_elsewhere(tmp_path, sections, straight, 4, 8, quiet)
    assert "model.time_embedding.table.weight" in final
    model = load_for_inference(tmp_path / "run", need_tokenizer=False).model
    assert model.model.time_embedding.fixed_step == 7
    _cached_decoding_is_the_full_forward(model)
    r = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert r.exit_code == 1 and "model.architecture.time" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "hf").exists()


def test_time_as_depth_runs_each_stage_at_its_step_and_resumes_across_the_grow_bitwise(tmp_path):
    """interpretation depth with two stacking stages (linear, time_per_stack 4): every row of stage k
    trains at step 4k; a checkpoint loads at its stage's step; a run resumed from stage 1's first
    checkpoint (after the grow) ends with the same bits and validation loss."""

    from run_helpers import make_dataset, resume_elsewhere, write_config

    from apr.apply import run_apply
    from apr.generate.load import load_for_inference
    from apr.steps.stacking import config_at

    depth = {"embedding_dim": 8, "num_time_steps": 10, "interpretation": "depth", "time_per_stack": 4}
    stacking = {"stages": [{"blocks": 1, "steps": 4}, {"blocks": 2}]}
    sections = {"model": {"architecture": {"time": depth}, "stacking": stacking},
                "training": {"engine": "standard", "max_steps": 8, "save_interval": 2, "eval_interval": 4}}
    config = make_config(model={"architecture": {"time": depth, "num_hidden_layers": 2}, "stacking": stacking},
                         training={"engine": "standard", "max_steps": 8})
    for step, want in ((4, 0), (5, 4)):
        engine = build_engine(plan_of(config_at(config, step)))
        (batch,) = batches(config, 1)
        assert engine.loss.time.steps(engine.model, batch, step).tolist() == [want, want]
    make_dataset(tmp_path, train_rows=64, val_rows=8)
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    straight = run_apply(write_config(tmp_path, **sections), **quiet)
    for step, want in ((4, 0), (6, 4)):
        loaded = load_for_inference(tmp_path / "run" / f"checkpoint-step-{step}.json", need_tokenizer=False)
        assert loaded.model.model.time_embedding.fixed_step == want
    resume_elsewhere(tmp_path, sections, straight, 6, 8, quiet)


def test_the_custom_loss_is_the_mean_cross_entropy_at_the_targets_not_ignored():
    """training.mode custom: a packed batch (ids, then targets; apr/data/loader.py) trains position i on
    target i + 1, the mean over the targets that are not -100; validation sums the same."""
    from apr.data.loader import IGNORE as LOADER_IGNORE

    config = make_config(training={"engine": "standard", "mode": "custom", "custom": {}})
    engine = build_engine(plan_of(config))
    ids, _ = engine.split(batches(config, 1)[0])
    row = torch.cat([ids, ids[:, :1]], dim=1)  # seq_len + 1 ids
    targets = (row * 7 + 3) % 53
    targets[0, 1:9] = IGNORE
    targets[1, 4] = IGNORE
    packed = torch.cat([row, targets], dim=1)
    part = engine.loss(engine, engine.model, *engine.split(packed))
    logits = engine.model(ids)
    kept = [(i, p) for i in range(2) for p in range(12) if targets[i, p + 1] != IGNORE]
    want = sum(F.cross_entropy(logits[i, p], targets[i, p + 1]) for i, p in kept) / len(kept)
    assert abs(part.item() - want.item()) < 1e-5 and len(kept) == 24 - 9 and LOADER_IGNORE == IGNORE
    total, count = engine.loss.eval_loss_sum(engine, packed)
    assert count == len(kept) and abs(total.item() / count - want.item()) < 1e-5
    alone = engine.loss(engine, engine.model, ids, row[:, 1:])  # ids alone (plan --trace, profile): causal
    assert torch.equal(alone, CausalLM()(engine, engine.model, ids, row[:, 1:]))


def test_a_custom_run_whose_targets_are_its_ids_is_the_causal_lm_bitwise_and_resumes_bitwise(tmp_path):
    """apr train apply with training.mode custom over shards whose targets column is the ids: the same
    weights and validation loss as the causal LM, bit for bit; resumed from its step-4 checkpoint, the
    same bits again."""

    import pyarrow as pa
    import pyarrow.parquet as pq
    from run_helpers import make_dataset, resume_elsewhere, write_config
    from safetensors.torch import load_file

    from apr.apply import run_apply

    make_dataset(tmp_path, train_rows=64, val_rows=8)
    for shard in sorted((tmp_path / "data").rglob("*.parquet")):  # targets = the ids, beside them
        table = pq.read_table(shard)
        ids = table.column("input_ids")
        pq.write_table(table.append_column("targets", ids.cast(pa.list_(pa.int32()))), shard)
    training = {"engine": "standard", "max_steps": 8, "save_interval": 4, "eval_interval": 4}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    causal = run_apply(write_config(tmp_path, "causal.yaml", training={**training, "output_dir": "causal/"}),
                       **quiet)
    custom = {**training, "mode": "custom", "custom": {"targets_column": "targets"}}
    straight = run_apply(write_config(tmp_path, training=custom), **quiet)
    assert straight.val_loss == causal.val_loss and straight.first_val_loss == causal.first_val_loss
    final = load_file(str(tmp_path / "run" / "checkpoint-step-8.safetensors"))
    plain = load_file(str(tmp_path / "causal" / "checkpoint-step-8.safetensors"))
    assert [k for k in final if not torch.equal(final[k], plain[k])] == []
    resume_elsewhere(tmp_path, {"training": custom}, straight, 4, 8, quiet)
