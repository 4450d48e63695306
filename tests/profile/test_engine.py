"""`apr profile CONFIG`: the engine the run would build (the block walk or autograd, under the
execution policy the plan resolves) is the one whose train_step is timed, on micro-batches of the
planned shape."""

from __future__ import annotations

import copy

import pytest
import yaml

torch = pytest.importorskip("torch")

from apr.profile import engine as engine_profile  # noqa: E402
from apr.profile.report import ProfileOptionError, ProfileOptions, profile_source  # noqa: E402

TINY = {
    "model": {"architecture": {
        "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": 53, "max_position_embeddings": 32}},
    "data": {"train": "not-built-yet/", "batch_size": 2, "seq_len": 12},
    "training": {"mixed_precision": "fp32", "device": "cpu", "kernels": "torch", "gradient_accumulation": 2},
}
STEPS = 2


def write_config(tmp_path, name: str, **training) -> str:
    doc = copy.deepcopy(TINY)
    doc["training"].update(training)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def built(monkeypatch):
    """Every engine build_engine returns while profiling, with the micro-batches of each train_step call."""
    engines = []
    real = engine_profile.build_engine

    def spy(resolved, device):
        engine = real(resolved, device)
        step, calls = engine.train_step, []

        def counted(micro_batches, lr):
            calls.append([tuple(b.shape) for b in micro_batches])
            return step(micro_batches, lr)

        engine.train_step = counted
        engines.append((engine, calls))
        return engine

    monkeypatch.setattr(engine_profile, "build_engine", spy)
    return engines


def profile(path, **options):
    return profile_source(path, ProfileOptions(steps=STEPS, latency=False, **options))


@pytest.mark.parametrize("engine, activations, source", [
    ("interleaved", "recompute", "interleaved"),
    ("standard", "keep", "standard"),
])
def test_the_engine_the_config_names_is_built_and_its_train_step_timed(tmp_path, built, engine, activations,
                                                                        source):
    path = write_config(tmp_path, engine, engine=engine, execution={"activations": activations, "gradients": "kept"})
    report = profile(path)
    (built_engine, calls), = built
    assert built_engine.source == source  # the walk for `interleaved`, autograd for `standard`
    assert report.kind == "config" and report.engine.engine == source and report.engine.gradient_source == source
    assert report.engine.execution["activations"] == activations
    assert report.engine.execution_basis == "stated in training.execution"
    # a warm-up step, the timed steps, one counted step: all of them the built engine's own
    assert len(calls) == 1 + STEPS + 1 and report.step.steps == STEPS == len(report.step.samples_s)
    # each step: training.gradient_accumulation micro-batches of data.batch_size x (seq_len + 1) ids
    assert all(shapes == [(2, 13), (2, 13)] for shapes in calls)
    assert report.step.tokens == 2 * 12 * 2 and report.step.step_s > 0
    assert report.parameters == sum(p.numel() for p in built_engine.model.parameters())


def test_the_walk_s_recompute_is_in_the_counted_flops(tmp_path, built):
    """The step counted is the walk under its policy: recomputing every block costs one more forward
    of the blocks, as the plan's hardware FLOPs (cost_f / 3) say."""
    counted, ratio = {}, {}
    for activations in ("keep", "recompute"):
        path = write_config(tmp_path, activations, engine="interleaved",
                            execution={"activations": activations, "gradients": "kept"})
        report = profile(path, compare=True)
        counted[activations] = report.step.counted_flops
        (flops,) = [c for c in report.comparison if c.figure == "flops_per_token"]
        ratio[activations] = flops.ratio
    assert counted["recompute"] > counted["keep"] * 1.2
    assert all(0.95 < r < 1.02 for r in ratio.values()), ratio


def test_an_auto_policy_is_the_plan_s_choice_for_this_device(tmp_path, built):
    path = write_config(tmp_path, "auto", engine="interleaved")
    report = profile(path)
    assert report.engine.execution_basis.startswith("auto, chosen by the plan to fit")
    (engine, _), = built
    assert report.engine.execution == engine.execution.to_dict()


def test_the_options_are_planned_as_settings_of_the_config(tmp_path, built):
    path = write_config(tmp_path, "walk", engine="interleaved")
    report = profile(path, batch_size=1, seq_len=8)
    (_, calls), = built
    assert all(shapes == [(1, 9), (1, 9)] for shapes in calls)
    assert (report.step.batch_size, report.step.seq_len, report.step.gradient_accumulation) == (1, 8, 2)


def test_a_config_laid_out_for_several_ranks_is_profiled_as_one_of_them(tmp_path, built):
    path = write_config(tmp_path, "ranks", engine="interleaved", world_size=2, sharding="full")
    report = profile(path)
    assert report.engine.world_size == 2 and report.engine.sharding == "full"
    assert report.engine.profiled_as.startswith("one rank of 2, sharding full, on one process")


def test_a_step_past_the_memory_is_refused_before_the_engine_is_built(tmp_path, built):
    path = write_config(tmp_path, "huge", engine="interleaved")
    with pytest.raises(ProfileOptionError, match="by the plan's memory estimate, more than"):
        profile(path, batch_size=10**8)
    assert built == []
