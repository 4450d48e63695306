"""The plan counts the time of in-training evaluation (evaluation.tasks / samples)."""

from __future__ import annotations

from apr.config.schema import AprConfig
from apr.model.spec import flops_per_token
from apr.plan.facts import evaluation_estimate
from apr.plan.gpus import resolve_target

BASE = {
    "model": {"architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256}},
    "data": {"train": "d/", "batch_size": 2, "seq_len": 64, "tokenizer": "tok.json"},
    "training": {"eval_interval": 100},
}

def config(**evaluation) -> AprConfig:
    return AprConfig.model_validate({**BASE, "evaluation": evaluation})

def test_no_evaluation_costs_nothing():
    assert evaluation_estimate(config(), 1000, None, "bf16") is None

def test_tasks_and_samples_are_counted_per_evaluation():
    cfg = config(tasks=["stdlib-nextline", "a.jsonl"], limit=10, samples={"prompts": ["x"], "max_new_tokens": 16})
    est = evaluation_estimate(cfg, 1050, None, "bf16")
    per_eval = 2 * 10 * 4 * 128 + 1 * (128 + 16)
    assert est["evaluations"] == 11  # every 100 steps, and the last step
    assert est["forward_tokens"] == 11 * per_eval
    assert est["total_flops"] == 11 * per_eval * flops_per_token(cfg.model.architecture, 128) // 3
    assert "estimated_seconds" not in est
    target = resolve_target("h100", None)
    timed = evaluation_estimate(config(tasks=["stdlib-nextline"], interval=500), 1000, target, "bf16")
    assert timed["evaluations"] == 2 and timed["estimated_seconds"] > 0
