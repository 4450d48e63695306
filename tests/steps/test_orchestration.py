"""apr/steps/orchestration.py: the built-in strategies resolved against the run's settings, and the
UCB1 bandit's choices (torch-free)."""

from __future__ import annotations

import math

from apr.config.schema import AprConfig
from apr.steps.orchestration import UCB1, candidates, resolve

ARCH = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": 50, "max_position_embeddings": 16}


def _config(**training) -> AprConfig:
    return AprConfig.model_validate({"model": {"architecture": ARCH}, "data": {"train": "t/", "batch_size": 1,
                                                                                "seq_len": 8},
                                     "optimizer": {"lr": 1e-3, "beta1": 0.8, "weight_decay": 0.05},
                                     "training": {"grad_clip": 0.5, **training}})


def test_built_in_strategies_are_settings_relative_to_the_runs_own():
    config = _config()
    assert resolve(config, "conservative_adamw").to_dict() == {
        "name": "conservative_adamw", "optimizer": "adamw", "lr_factor": 1.0, "beta1": 0.8, "beta2": 0.95,
        "weight_decay": 0.05, "clip_mode": "global", "grad_clip": 0.5}
    assert resolve(config, "spike_resistant").grad_clip == 0.125 and resolve(config, "spike_resistant").lr_factor < 1
    sgd = resolve(config, "sgd_escape")
    assert sgd.optimizer == "sgd" and math.isclose(sgd.weight_decay * sgd.lr_factor, 0.05)


def test_a_users_strategy_redefines_a_built_in_and_a_run_without_clipping_clips_nothing():
    config = _config(grad_clip=None, orchestrator={"strategies": {"sgd_escape": {"optimizer": "sgd", "beta1": 0.5},
                                                                   "mine": {"lr_factor": 3}}})
    assert resolve(config, "sgd_escape").beta1 == 0.5 and resolve(config, "sgd_escape").lr_factor == 1.0
    assert resolve(config, "mine").clip_mode == "off" and resolve(config, "mine").grad_clip is None
    assert candidates(config)[-1] == "mine" and len(candidates(config)) == 5


def test_ucb1_pulls_every_arm_once_then_balances_reward_and_uncertainty():
    bandit = UCB1(["a", "b", "c"], exploration=0.1)
    assert bandit.choose(2) == ["a", "b"]  # unpulled arms first, in their listed order
    for arm, reward in (("a", 1.0), ("b", 0.2), ("c", 0.5)):
        bandit.update(arm, reward)
    assert bandit.choose(3) == ["a", "c", "b"]
    explorer = UCB1(["a", "b"], exploration=10.0)
    for _ in range(5):
        explorer.update("a", 1.0)
    explorer.update("b", 0.0)
    assert explorer.choose(1) == ["b"]  # pulled once: its bound dominates at a large c


def test_the_bandits_state_round_trips_so_a_resume_decides_alike():
    bandit = UCB1(["a", "b"], exploration=1.0)
    bandit.update("b", 0.3)
    other = UCB1(["a", "b"], exploration=1.0)
    other.load_state_dict(bandit.state_dict())
    assert other.choose(2) == bandit.choose(2) and other.score("b") == bandit.score("b")
