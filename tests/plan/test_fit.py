"""`apr train plan --fit` (apr/plan/fit.py): the fastest layout of the global batch within the budget."""

from __future__ import annotations

import json
import re
import time

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config.loader import read_yaml
from apr.plan.build import build_plan
from apr.plan.examples import materialize
from apr.plan.fit import HEADROOM, Candidate, fit_plan

runner = CliRunner()

# 4 blocks of width 256, a global batch of 64 sequences of 128 tokens (16 x accumulation 4): the layouts'
# peaks run from ~0.8 GiB (micro-batch 1) to ~1.4 GiB (64, nothing recomputed) on a GPU
EXAMPLE = {"config": {"model": {"architecture": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "intermediate_size": 768,
                                                 "vocab_size": 512, "max_position_embeddings": 128}},
                      "data": {"batch_size": 16, "seq_len": 128},
                      "training": {"device": "cuda", "gradient_accumulation": 4, "max_steps": 4,
                                   "mixed_precision": "fp16"}},
           "train": {"rows": 256, "shards": 1}}
GLOBAL = 64


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path, _ = materialize(EXAMPLE, tmp_path_factory.mktemp("fit"))
    return path


@pytest.fixture(scope="module")
def unbounded(config):
    """The fit on an H100: every layout fits, so the search is over time alone."""
    return fit_plan(build_plan(config, gpu="h100"))


def _vram_between(fit) -> int:
    """A memory size whose budget lies between the smallest and the largest layout's peak."""
    peaks = [c.peak_bytes for c in fit.candidates]
    return int((min(peaks) + max(peaks)) / 2 / (1 - HEADROOM))


def test_every_candidate_keeps_the_global_batch(config, unbounded):
    assert unbounded.global_batch == GLOBAL
    assert {c.batch_size for c in unbounded.candidates} == {1, 2, 4, 8, 16, 32, 64}
    assert all(c.batch_size * c.accumulation == GLOBAL for c in unbounded.candidates)
    # on 4 ranks over 2 nodes: 16 sequences a rank, and each sharding strategy is a candidate
    fit = fit_plan(build_plan(config, gpu="h100", world_size=4, nodes=2))
    assert all(c.batch_size * c.accumulation * 4 == GLOBAL for c in fit.candidates)
    assert {c.sharding for c in fit.candidates} == {"none", "shard_grad_op", "hybrid", "full"}
    assert fit.changed["training.world_size"] == 4 and fit.changed["training.nodes"] == 2
    # the keys a fit changes are layout keys only
    layout = {"data.batch_size", "training.gradient_accumulation", "training.execution.activations",
              "training.execution.gradients", "training.sharding", "training.execution.compile",
              "training.world_size", "training.nodes"}
    assert set(fit.changed) <= layout and set(unbounded.changed) <= layout


def test_the_fit_never_exceeds_the_budget_and_picks_the_fastest_fitting(config, unbounded):
    vram = _vram_between(unbounded)
    fit = fit_plan(build_plan(config, gpu="t4", vram=vram))
    assert fit.budget_bytes == int(vram * (1 - HEADROOM))
    assert all(c.fits == (c.peak_bytes <= fit.budget_bytes) for c in fit.candidates)
    fitting = [c for c in fit.candidates if c.fits]
    assert fit.chosen.fits and fit.chosen.peak_bytes <= fit.budget_bytes
    assert fit.chosen == min(fitting, key=Candidate.rank_key)
    assert all(fit.chosen.tokens_per_s >= c.tokens_per_s for c in fitting)
    # the budget binds: the unbounded winner (the largest micro-batch, nothing recomputed) is over it
    best = unbounded.chosen
    assert best.batch_size == GLOBAL and best.peak_bytes > fit.budget_bytes
    assert fit.chosen.batch_size < GLOBAL


def test_out_writes_an_extends_file_that_plans_to_the_chosen_layout(config, unbounded):
    vram = _vram_between(unbounded)
    out = config.parent / "fitted.yaml"
    args = ["train", "plan", str(config), "--gpu", "t4", "--vram", str(vram), "--fit", "--json", "-out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["fit"]
    assert doc["chosen"] and doc["candidates"]
    first = doc["candidates"][0]
    assert set(first) >= {"keys", "peak_bytes", "tokens_per_s", "fits"} and first["fits"]
    assert all(v == first["keys"][k] for k, v in doc["chosen"].items())
    # the file extends the config and sets the changed keys, nothing else
    raw, _, _ = read_yaml(out)
    assert raw.pop("extends") == config.name

    def flat(node, prefix=""):
        for k, v in node.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    assert dict(flat(raw)) == doc["chosen"]
    fitted = build_plan(out, gpu="t4", vram=vram)
    assert fitted.errors == []
    c = fitted.config
    assert (c.data.batch_size, c.training.gradient_accumulation) == (first["keys"]["data.batch_size"],
                                                                     first["keys"]["training.gradient_accumulation"])
    assert c.data.batch_size * c.training.gradient_accumulation == GLOBAL
    policy = fitted.execution["policy"]
    assert (policy["activations"], policy["gradients"]) == (first["keys"]["training.execution.activations"],
                                                            first["keys"]["training.execution.gradients"])
    assert fitted.facts["memory"]["total_bytes"] == first["peak_bytes"]
    # never over an existing file without --overwrite
    before = out.read_text()
    again = runner.invoke(app, args[:-3] + ["-out", str(out)])
    assert again.exit_code == 1 and "--overwrite" in again.output and out.read_text() == before
    assert runner.invoke(app, args + ["--overwrite"]).exit_code == 0


def test_the_text_output_shows_the_choice_why_and_the_best_candidates(config, unbounded):
    result = runner.invoke(app, ["train", "plan", str(config), "--vram", str(_vram_between(unbounded)),
                                 "--gpu", "t4", "--fit"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "Fit (--fit): the fastest layout within" in text and "global batch kept: 64 sequences" in text
    assert "why: the fastest of" in text and "<- chosen" in text
    assert "Resolved run" in text and "Plan:" in text.splitlines()[-1]


def test_a_global_batch_the_ranks_cannot_split_is_refused_with_the_nearest(config):
    result = runner.invoke(app, ["train", "plan", str(config), "--gpu", "h100", "--fit", "--world-size", "3"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "global batch of 64 sequences" in result.output and "cannot be split over 3 ranks" in result.output
    assert "63 or 66 sequences" in result.output


def test_nothing_fits_names_the_smallest_layout_and_what_to_change(config):
    result = runner.invoke(app, ["train", "plan", str(config), "--vram", "900MiB", "--fit"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert re.search(r"the smallest, batch_size 1 x accumulation 64, recompute .* needs [\d.]+ MiB per GPU "
                     r"against a budget of 810\.00 MiB", text), text
    assert "a larger GPU (--gpu)" in text and "a shorter data.seq_len" in text


def test_fit_needs_a_budget_and_a_yaml_out(config, tmp_path):
    result = runner.invoke(app, ["train", "plan", str(config), "--fit"])  # device cuda, no target
    assert result.exit_code == 1 and "--fit needs a memory budget" in result.output
    result = runner.invoke(app, ["train", "plan", str(config), "--gpu", "h100", "--fit", "-out",
                                 str(tmp_path / "plan.json")])
    assert result.exit_code == 2 and "a .yaml file" in result.output


def test_the_350m_config_fits_a_4090_keeping_its_global_batch(repo, tmp_path, monkeypatch):
    """The reference config on its stand-in data (`apr data synth --like`), as docs/plan.md shows it."""
    config = repo / "configs/train/pretrain-350m-v2.yaml"
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["data", "synth", "--like", str(config), "--out", "standin"]).exit_code == 0
    monkeypatch.chdir(tmp_path / "standin")
    t0 = time.monotonic()
    result = runner.invoke(app, ["train", "plan", str(config), "--gpu", "4090", "--fit", "--json"])
    seconds = time.monotonic() - t0
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    fit, layout = doc["fit"], doc["fit"]["layout"]
    assert layout["data.batch_size"] * layout["training.gradient_accumulation"] == fit["global_batch_sequences"] == 4
    assert fit["peak_bytes"] <= fit["budget_bytes"] == int(fit["vram_bytes"] * (1 - HEADROOM))
    assert doc["summary"]["errors"] == 0 and doc["memory"]["total_bytes"] == fit["peak_bytes"]
    assert seconds < 30  # measured 3.3-3.7 s wall (1.2 s of CPU) on the loaded 2-core box; docs/plan.md


def test_with_trace_the_chosen_layout_is_the_one_traced(config):
    """`--fit --trace`: the fake-tensor trace checks the fitted plan (the chosen layout), not the
    config as written, before the choice is printed."""
    result = runner.invoke(app, ["train", "plan", str(config), "--gpu", "h100", "--fit", "--trace", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    layout = doc["fit"]["layout"]
    assert (layout["data.batch_size"], layout["training.gradient_accumulation"]) != (16, 4)  # the fit changed it
    assert doc["config"]["data"]["batch_size"] == layout["data.batch_size"]
    assert doc["config"]["training"]["gradient_accumulation"] == layout["training.gradient_accumulation"]
    trace = doc["trace"]
    assert 0.9 < trace["peak_bytes"] / trace["plan_peak_bytes"] < 1.1  # the fitted plan's peak, traced


def _record_probe(config_path, candidate: Candidate, tokens_per_s: float) -> None:
    """A probe of ``candidate``'s shape on this CPU, as `apr train plan --probe` records one."""
    from apr import __version__
    from apr.config import load_config
    from apr.plan.facts import cpu_threads
    from apr.track import calibration

    config = load_config(config_path, {"data.batch_size": candidate.batch_size,
                                       "training.gradient_accumulation": candidate.accumulation}).config
    step = candidate.batch_size * candidate.accumulation * config.data.seq_len / tokens_per_s
    probe = {"source": "probe", "device": "cpu", "device_name": calibration.host_cpu_name(),
             "versions": {"torch": calibration.torch_version(), "cuda": None, "apr": __version__, "python": "3"},
             "tokens_per_s": tokens_per_s, "step_seconds": step, "step_seconds_all": [step], "startup_seconds": 1.0,
             "load": 0.5, "threads": 1, "rows": []}
    threads = cpu_threads(config, 1)["threads"]
    calibration.record(probe, calibration.shape(config, candidate.execution.to_dict(), threads))


def test_calibrations_replace_the_model_where_they_exist(tmp_path, monkeypatch):
    monkeypatch.setattr("apr.steps.execution.compile_problem", lambda device: "no compiler in this test")
    cfg, _ = materialize({"config": {"data": {"batch_size": 4}, "training": {"max_steps": 10}}}, tmp_path / "cal")
    before = fit_plan(build_plan(cfg))  # the CPU's assumed rate: every micro-batch ties, the largest wins
    assert before.chosen.batch_size == 4 and {c.basis for c in before.candidates} == {"model"}
    by_batch = {c.batch_size: c for c in before.candidates}
    _record_probe(cfg, by_batch[1], 1000.0)  # measured: micro-batch 1 is twice as fast as 2
    _record_probe(cfg, by_batch[2], 500.0)
    fit = fit_plan(build_plan(cfg))
    after = {c.batch_size: c for c in fit.candidates}
    assert after[1].basis == after[2].basis == "measured" and after[1].tokens_per_s == pytest.approx(1000.0)
    # micro-batch 4 has no probe: the model's time, scaled by the median of measured / modelled over the
    # probes (the mean of the two: 1.5 x the model's time at 1,000 tokens/s)
    assert after[4].basis == "model scaled to measurements"
    assert after[4].tokens_per_s == pytest.approx(1000.0 / 1.5)
    assert fit.chosen.batch_size == 1 and "measured by probes or runs" in " ".join(fit.notes)


def test_a_fitted_file_whose_base_the_loader_would_refuse_is_not_written(config, tmp_path, monkeypatch):
    monkeypatch.delenv("APR_EXTENDS_ANYWHERE", raising=False)
    out = tmp_path / "elsewhere" / "fitted.yaml"  # outside the config's folder (no repository holds either)
    result = runner.invoke(app, ["train", "plan", str(config), "--gpu", "h100", "--fit", "-out", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"-out {out} not written" in result.output and "config.extends_outside" in result.output
    assert not out.exists() and list(out.parent.iterdir()) == []  # no temporary file left either


# ------------------------------------------------------------------------------------ auto keys


def _auto_config(config, name: str, text: str):
    path = config.parent / name
    path.write_text(f"extends: {config.name}\n{text}")
    return path


def test_auto_counts_are_fitted_at_plan_time_and_the_resolved_plan_runs_them(config, unbounded):
    from apr.plan.fit import fitted_settings
    from apr.plan.planfile import check_plan_fresh

    auto = _auto_config(config, "auto.yaml", "data:\n  batch_size: auto\n  global_batch_size: 64\n"
                                             "training:\n  gradient_accumulation: auto\n")
    vram = _vram_between(unbounded)
    plan = build_plan(auto, gpu="t4", vram=vram)
    record = plan.facts["fitted"]
    batch, accumulation = record["keys"]["data.batch_size"], record["keys"]["training.gradient_accumulation"]
    assert set(record["keys"]) == {"data.batch_size", "training.gradient_accumulation"} and batch * accumulation == 64
    # the budget binds (the unbounded winner, micro-batch 64, is over it) and the fitted layout is within it
    assert batch < GLOBAL and record["peak_bytes"] <= record["budget_bytes"] == int(vram * (1 - HEADROOM))
    assert plan.errors == [] and plan.facts["memory"]["total_bytes"] == record["peak_bytes"]
    # the same choice as --fit over the micro-batches of the config's own layout (compile as stated)
    stated = fit_plan(build_plan(config, gpu="t4", vram=vram))
    assert batch == max((c for c in stated.candidates if c.fits and not c.execution.compile),
                        key=lambda c: (-c.score, c.batch_size)).batch_size
    # what apply runs: the plan's Resolved carries the fitted counts
    resolved = plan.resolved.config
    assert (resolved.data.batch_size, resolved.training.gradient_accumulation) == (batch, accumulation)
    finding = next(f for f in plan.findings if f.code == "plan.auto_fit")
    assert (finding.file, finding.line, finding.path) == (str(auto), 3, "data.batch_size")
    assert f"data.batch_size auto -> {batch}" in finding.message
    assert "global batch of 64 sequences kept" in finding.message
    # a saved plan keeps the values: it is fresh, and apply reads them back instead of fitting again
    doc = json.loads(json.dumps(plan.to_dict()))
    assert fitted_settings(doc) == record["keys"] and doc["overrides"] == {}
    assert check_plan_fresh(doc) == auto


def test_auto_sharding_is_fitted_on_several_ranks_and_none_on_one(config):
    from apr.plan.build import plan_config

    auto = _auto_config(config, "auto-sharding.yaml", "training:\n  sharding: auto\n")
    assert build_plan(auto, gpu="h100").facts["fitted"]["keys"] == {"training.sharding": "none"}
    stand_in = plan_config(auto, gpu="h100", world_size=4, overrides={"training.world_size": 4})
    peaks = {c.sharding: c.peak_bytes for c in fit_plan(stand_in, free=("training.sharding",)).candidates}
    assert peaks["full"] < peaks["none"]
    vram = int((peaks["full"] + peaks["none"]) / 2 / (1 - HEADROOM))  # none does not fit, full does
    plan = build_plan(auto, vram=vram, world_size=4)
    chosen = plan.facts["fitted"]["keys"]
    assert chosen["training.world_size"] == 4 and chosen["training.sharding"] != "none"
    assert peaks[chosen["training.sharding"]] <= plan.facts["fitted"]["budget_bytes"]
    assert plan.resolved.sharding == chosen["training.sharding"]


def test_auto_that_nothing_fits_is_refused_by_plan(config):
    auto = _auto_config(config, "auto-small.yaml", "data:\n  batch_size: auto\n  global_batch_size: 64\n")
    result = runner.invoke(app, ["train", "plan", str(auto), "--vram", "900MiB"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no layout of the global batch fits" in " ".join(result.output.split())
    result = runner.invoke(app, ["train", "plan", str(auto)])  # device cuda, no target: no budget to fit
    assert result.exit_code == 1 and "data.batch_size: auto: --fit needs a memory budget" in result.output
