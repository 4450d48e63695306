"""Assemble the ``facts`` that contract rules read. Python computes numbers here, never verdicts.

Facts that cannot be known (no data folder, no target GPU, ...) are left out of the dict rather
than set to null; contracts list what they ``require`` and are skipped when it is absent.
"""

from __future__ import annotations

import math
import time

from apr import __version__, hardware, threads  # threads first: it sets OpenMP's wait policy before torch loads
from apr.config.schema import AprConfig
from apr.model.spec import (
    flops_per_token,
)
from apr.plan import compilefacts
from apr.plan.configfacts import (  # validate's facts (config only), shared
    FactSheet,
    config_facts,
    memory_facts,
    model_facts,
)
from apr.plan.datafacts import data_manifests, dataset_facts, shared_shards
from apr.plan.gpus import Target
from apr.plan.mixfacts import merged_train_facts, source_dataset_facts
from apr.plan.stackfacts import stacking_facts
from apr.plan.storage import storage_facts
from apr.plan.tokfacts import tokenizer_facts
from apr.steps.algebra import step_algebra
from apr.steps.schedule import LRSchedule
from apr.track import calibration


def time_estimate(tokens: int, flops_per_tok: int, target: Target | None, precision: str,
                  world_size: int, basis: str, cost_f: float = 3.0) -> dict | None:
    """Wall time at the catalogue GPU's assumed MFU. An estimate: it says so in every field name.
    None when the GPU or its peak for ``precision`` is unknown (facts.mfu says why).

    ``cost_f``: forward-equivalents per step of the chosen execution (apr/steps/execution.py). The
    model FLOPs (6N + attention) are a plain loop's 3F; recompute and a norm-only pre-pass walk add
    work the GPU runs at the same rate, so the time scales by ``cost_f / 3``."""
    if target is None or target.gpu is None:
        return None
    peak = target.gpu.peak_flops(precision)
    if peak is None:
        return None
    total_flops = tokens * flops_per_tok
    executed_flops = total_flops * cost_f / 3.0
    seconds = executed_flops / (peak * target.gpu.mfu * world_size)
    return {"tokens": tokens, "flops_per_token": flops_per_tok, "total_flops": total_flops,
            "execution_cost_f": cost_f, "executed_flops": executed_flops,
            "peak_flops_per_gpu": peak, "assumed_mfu": target.gpu.mfu, "gpus": world_size,
            "precision": precision, "estimated_seconds": seconds, "basis": basis}


EVAL_CHOICES = 4  # choices per multiple-choice example assumed by the estimate (stdlib-nextline has 4)
EVAL_TOKENS = 128  # tokens per scored sequence assumed (context + choice), at most the model's context


def evaluation_estimate(config: AprConfig, total_steps: int, target: Target | None, precision: str) -> dict | None:
    """Forward work of in-training evaluation (``evaluation.tasks`` and ``samples``, docs/eval.md)
    over the run: evaluations x (examples x choices x tokens + sample tokens), at 1/3 of the
    training FLOPs per token (a forward pass). Rank 0 evaluates alone, so it is not divided by the
    number of GPUs. None when no evaluation is configured."""
    ev, tr = config.evaluation, config.training
    interval = ev.interval or tr.eval_interval
    if not (ev.tasks or ev.samples) or interval <= 0 or total_steps < 1:
        return None
    arch = config.model.architecture
    seq = min(arch.max_position_embeddings, EVAL_TOKENS)
    evaluations = total_steps // interval + (1 if total_steps % interval else 0)
    per_eval = len(ev.tasks) * ev.limit * EVAL_CHOICES * seq
    if ev.samples is not None:
        per_eval += len(ev.samples.prompts) * (seq + ev.samples.max_new_tokens)
    flops = evaluations * per_eval * flops_per_token(arch, seq) // 3
    out = {"evaluations": evaluations, "forward_tokens": evaluations * per_eval, "total_flops": flops}
    peak = target.gpu.peak_flops(precision) if target is not None and target.gpu is not None else None
    if peak is not None:
        out["estimated_seconds"] = flops / (peak * target.gpu.mfu)
    return out


def peak_lr_reached(config: AprConfig, total_steps: int) -> float:
    """The highest learning rate the schedule reaches in ``total_steps`` steps (warmup may not end)."""
    if total_steps < 1:
        return 0.0
    schedule = LRSchedule.from_config(config, total_steps)
    warmup = config.training.warmup_steps
    return schedule(min(total_steps, warmup)) if warmup else schedule(1)


def all_facts(config: AprConfig, *, world_size: int, target: Target | None, nodes: int | None = None,
              device_budget: tuple[int, str] | None = None) -> FactSheet:
    """Config facts plus data (Parquet footers), tokenizer and step algebra, and the time estimate."""

    sheet = config_facts(config, world_size=world_size, nodes=nodes, target=target, device_budget=device_budget)
    facts = sheet.facts
    data, tr = config.data, config.training
    if data.sources is not None:  # a mixture: each source's facts, and the sources together as "train"
        per_source = source_dataset_facts(config, dataset_facts)
        data_facts: dict = {"sources": per_source, "train": merged_train_facts(per_source)}
    else:
        data_facts = {"train": dataset_facts(data.train, data.input_column)}
    if data.val is not None:
        data_facts["val"] = dataset_facts(data.val, data.input_column)
        if data.sources is None:
            data_facts["val_shared_shards"] = shared_shards(data.train, data.val)
    maxima = [(d["max_token_id"], name) for name, d in (("train", data_facts["train"]), ("val", data_facts.get("val")))
              if d and d.get("has_statistics")]
    if maxima:
        data_facts["max_token_id"], data_facts["max_token_id_in"] = max(maxima)
    facts["data"] = data_facts
    if data.tokenizer is not None:

        facts["tokenizer"] = tokenizer_facts(data.tokenizer, data_manifests(data))

    train = data_facts["train"]
    if "sequences" in train:
        steps = step_algebra(
            num_sequences=train["sequences"], batch_size=data.batch_size,
            gradient_accumulation=tr.gradient_accumulation, world_size=world_size, epochs=tr.epochs,
            max_steps=tr.max_steps, warmup_steps=tr.warmup_steps, save_interval=tr.save_interval,
            seq_len=data.seq_len)
        facts["steps"] = {k: v for k, v in steps.to_dict().items() if v is not None}
        facts["steps"]["tokens_per_param"] = steps.total_tokens / facts["model"]["params"]
        facts["steps"]["peak_lr_reached"] = peak_lr_reached(config, steps.total_steps)
        tokens, basis = steps.total_tokens, "the step algebra over the data"
    elif tr.max_steps is not None:
        tokens, basis = tr.max_steps * facts["schedule"]["tokens_per_step"], "max_steps (the data is unreadable)"
    else:
        tokens, basis = None, ""
    if tokens is not None:
        sheet.time_estimate = time_estimate(tokens, facts["model"]["flops_per_token"], target,
                                            str(tr.mixed_precision), world_size, basis,
                                            cost_f=facts["execution"]["cost_f"])
        evaluation = evaluation_estimate(config, tokens // facts["schedule"]["tokens_per_step"], target,
                                         str(tr.mixed_precision))
        if evaluation is not None:
            facts["evaluation"] = evaluation
            if sheet.time_estimate is not None:  # the run's time includes its in-training evaluation
                sheet.time_estimate["evaluation"] = evaluation
                sheet.time_estimate["estimated_seconds"] += evaluation["estimated_seconds"]
        if config.model.stacking is not None:  # every stage at its own depth: fewer FLOPs than the full model
            def stage_sheet(staged, stage_tokens):
                model = model_facts(staged)
                memory, _rows, choice = memory_facts(staged, target, device_budget)
                cost_f = choice.facts(staged).get("cost_f", 3.0)
                estimate = (time_estimate(stage_tokens, model["flops_per_token"], target, str(tr.mixed_precision),
                                          world_size, "the stage's steps", cost_f=cost_f) if stage_tokens else None)
                return model, memory, estimate

            stacked = stacking_facts(config, tokens // facts["schedule"]["tokens_per_step"],
                                     facts["schedule"]["tokens_per_step"], stage_sheet, train.get("sequences"))
            facts["stacking"] = stacked
            if sheet.time_estimate is not None and stacked["estimated_seconds"] is not None:
                evaluation_s = (sheet.time_estimate.get("evaluation") or {}).get("estimated_seconds", 0.0)
                sheet.time_estimate.update(estimated_seconds=stacked["estimated_seconds"] + evaluation_s,
                                           stacked_flops=stacked["total_flops"],
                                           stacked_seconds=stacked["estimated_seconds"])
        if sheet.time_estimate is not None:
            facts["time"] = {"estimated_seconds": sheet.time_estimate["estimated_seconds"],
                             "total_flops": sheet.time_estimate["total_flops"]}
    facts["threads"] = cpu_threads(config, world_size, nodes)
    run_policy = facts["execution"]["policy"]
    auto = config.training.execution.compile == "auto"  # the compiled policy's rows, and the run's own
    compiled_cal = (calibration_facts(config, {**run_policy, "compile": True}, target, world_size=world_size,
                                      nodes=nodes) if auto else None)
    # last: calibration.SKIPPED then names what the read of the run's own policy skipped
    calibrated = calibration_facts(config, run_policy, target, world_size=world_size, nodes=nodes)
    skipped = calibration.skipped_warnings() if calibration.SKIPPED else None
    total_steps = tokens // facts["schedule"]["tokens_per_step"] if tokens is not None else None
    decision = compilefacts.decide(config, facts, target, total_steps, calibrated if auto else None, compiled_cal)
    nodes_planned = tr.nodes if nodes is None else nodes
    ranked = config if (tr.world_size, tr.nodes) == (world_size, nodes_planned) else config.model_copy(
        update={"training": tr.model_copy(update={"world_size": world_size, "nodes": nodes_planned})})
    compilefacts.record(sheet, config, ranked, decision)
    if auto and decision.compile and compiled_cal is not None:  # else the eager rate: a cautious estimate
        calibrated = compiled_cal
    compiling = None  # a compiled run's compile time: its own term, never in the measured step time
    if facts["execution"]["policy"].get("compile"):
        compiled_summary = compiled_cal if auto else calibrated
        compiling = compilefacts.compile_term(compilefacts.compile_device(config, target), compiled_summary)
    if skipped:  # malformed rows were left out: the plan says which
        facts["calibration_skipped"] = skipped
    if calibrated is not None:
        facts["calibration"] = calibrated
        if tokens is not None:  # measured beats assumed: the probe's or the runs' tokens/s on this device
            sheet.time_estimate = calibrated_estimate(
                config, tokens, facts["model"]["flops_per_token"], calibrated, world_size, basis,
                facts["execution"]["cost_f"], facts["threads"], compiling=compiling)
            facts["time"] = {k: sheet.time_estimate[k] for k in (
                "estimated_seconds", "total_flops", "calibrated", "low_seconds", "high_seconds", "base_seconds",
                "base_kind", "startup_seconds", "tokens_per_s", "loop_tokens_per_s", "tokens_per_s_low",
                "tokens_per_s_high", "assumes", "compile_seconds", "compile") if k in sheet.time_estimate}
    facts["storage"] = storage_facts(config, total_steps, (sheet.time_estimate or {}).get("estimated_seconds"),
                                     world_size)
    if tr.price_per_gpu_hour is not None:
        facts["cost"] = cost_facts(tr.price_per_gpu_hour, world_size, tokens, sheet.time_estimate, facts)
    return sheet


def cpu_threads(config: AprConfig, world_size: int, nodes: int | None = None) -> dict:
    """The intra-op threads apply and the probe give each process (apr/threads.py); the same
    function decides at run time, so plan, probe and run agree."""
    return threads.for_config(config, world_size=world_size, nodes=nodes)


def calibration_facts(config: AprConfig, policy: dict, target: Target | None, *, world_size: int = 1,
                      nodes: int | None = None) -> dict | None:
    """Probes and finished runs of this run's shape on its device with this torch and apr
    (apr/track/calibration.py): a CPU run matches those of this host's CPU at the same intra-op
    threads; a GPU run those of the target GPU."""
    if str(config.training.device) == "cpu":
        shape_doc = calibration.shape(config, policy, cpu_threads(config, world_size, nodes)["threads"])
        rows = calibration.matching("cpu", calibration.host_cpu_name(), shape_doc, __version__)
    elif target is not None and target.gpu is not None:
        shape_doc = calibration.shape(config, policy)
        rows = [r for r in calibration.matching_shape("cuda", shape_doc, __version__)
                if (g := hardware.from_device_name(r["device_name"])) is not None and g.name == target.gpu.name]
    else:
        return None
    return calibration.summary(rows)


RANGE_FLOOR = 0.10  # log-width no measurement removes: data, checkpoint writes, the OS (about +-10%)
LOAD_WEIGHT = 0.5  # share of the CPU contention's log the load may move by while the run lasts
FRESH_S = 120.0  # a probe this recent saw the load of now (the plan right after --probe)


def validations(config: AprConfig, total_steps: int) -> int:
    """Validation passes of a run (apr/train/cadence.py): the start, every eval_interval steps, the end."""
    interval = config.training.eval_interval
    if config.data.val is None or interval <= 0 or total_steps < 1:
        return 0
    return 1 + total_steps // interval + (1 if total_steps % interval else 0)


def calibrated_estimate(config: AprConfig, tokens: int, flops_per_tok: int, cal: dict, world_size: int, basis: str,
                        cost_f: float, threads_choice: dict, load_now: float | None = None,
                        compiling: dict | None = None) -> dict:
    """Wall time from measured tokens/s, with a range (docs/plan.md, "The time estimate's range").

    point = (compute + validation + start-up) x the runs' correction x the load change, where
    compute = tokens / (tokens/s x processes); on a probe basis validation is its forward passes
    at the probe's step rate (a forward is 1 of the step's ``cost_f`` forward-equivalents), and
    start-up is the probe's own (imports, plan, engine). The range is point x exp(+-w), w the root
    sum of squares of: the basis's spread (probe steps or runs), the correction's spread, the load
    (``LOAD_WEIGHT`` x log contention at the busier of calibration time and now) and a floor.
    ``compiling`` (compiled blocks; apr/plan/compilefacts.py ``compile_term``): what compiling
    costs at the cache's state, added as its own term, outside the measured rate and the range."""
    tr = config.training
    tokens_per_step = config.data.batch_size * config.data.seq_len * tr.gradient_accumulation * world_size
    total_steps = max(1, tokens // max(1, tokens_per_step))
    rate = cal["tokens_per_s"]
    compute = tokens / (rate * world_size)
    startup = cal.get("startup_seconds") or 0.0
    evaluation = 0.0
    if cal["basis"] == "probe":  # runs' rates include their validation; a probe's step does not
        forward_s = cal["step_seconds"] / (tr.gradient_accumulation * max(cost_f, 1.0))
        evaluation = validations(config, total_steps) * tr.eval_batches * forward_s
    base = compute + evaluation + startup
    correction = cal.get("correction") or {}
    factor = correction.get("factor", 1.0)
    n, cores = threads_choice["threads"], threads_choice["cores"]
    load_cal = cal.get("load")
    fresh = cal.get("basis_time") is not None and abs(_now() - cal["basis_time"]) < FRESH_S
    if load_now is None:
        load_now = load_cal if fresh else threads.load_average()
    if str(tr.device) != "cpu":  # a GPU's step does not share the host's cores: no load terms
        load_cal = load_now = None
    c_cal, c_now = threads.contention(load_cal, n, cores), threads.contention(load_now, n, cores)
    load_factor = c_now / c_cal if load_cal is not None and load_now is not None else 1.0
    point = (compute + evaluation) * factor * load_factor + startup * factor
    compile_s = compiling["seconds"] if compiling else 0.0
    widths = {"basis": cal.get("spread") or 0.0, "correction": correction.get("spread", 0.0),
              "load": LOAD_WEIGHT * math.log(max(c_cal, c_now)), "floor": RANGE_FLOOR}
    w = math.sqrt(sum(v * v for v in widths.values()))
    loop_rate = rate / (factor * load_factor)  # per process, what drift compares the loop with
    assumes = {"device": str(tr.device), "device_name": cal["device_name"], "threads": n,
               "threads_source": threads_choice["source"], "cores": cores, "load_at_calibration": load_cal,
               "load_now": load_now, "contention_at_calibration": c_cal, "contention_now": c_now,
               "load_factor": load_factor, "correction_factor": factor, "basis": cal["basis"]}
    return {
        "calibrated": True, "tokens": tokens, "flops_per_token": flops_per_tok,
        "total_flops": tokens * flops_per_tok, "tokens_per_s": rate, "gpus": world_size, "basis": basis,
        "compute_seconds": compute, "evaluation_seconds": evaluation, "startup_seconds": startup,
        "base_seconds": base, "base_kind": cal["basis"], "estimated_seconds": point + compile_s,
        "low_seconds": point * math.exp(-w) + compile_s, "high_seconds": point * math.exp(w) + compile_s,
        "range_log_width": w, **({"compile_seconds": compile_s, "compile": compiling} if compiling else {}),
        "range_widths": widths, "tokens_per_s_low": loop_rate * math.exp(-w), "tokens_per_s_high":
        loop_rate * math.exp(w), "loop_tokens_per_s": loop_rate, "assumes": assumes,
        "calibration": f"calibrated from {cal['what']} on {cal['date']} ({cal['device_name']})"}


def _now() -> float:
    return time.time()


def cost_facts(price: float, world_size: int, tokens: int | None, estimate: dict | None, facts: dict) -> dict:
    """The run's price: the estimated wall time (compute and in-training evaluation at the assumed
    MFU, plus the time training waits for checkpoint writes, during which the GPUs are billed too)
    x GPUs x the price per GPU-hour, and per billion training tokens. Unknown (with the reason)
    without a time estimate."""
    out: dict = {"price_per_gpu_hour": price, "gpus": world_size, "known": False}
    if estimate is None or not tokens:
        mfu = facts.get("mfu") or {}
        out["reason"] = ("no time estimate: " + (mfu["reason"] if not mfu.get("known", True)
                                                 else "the number of steps is unknown"))
        return out
    writes = (facts.get("storage") or {}).get("blocking_seconds") or 0.0  # training waiting for the disk
    seconds = estimate["estimated_seconds"] + writes
    gpu_hours = seconds * world_size / 3600
    total = gpu_hours * price
    out.update({"known": True, "seconds": seconds, "checkpoint_write_seconds": writes, "gpu_hours": gpu_hours,
                "total": total, "tokens": tokens, "per_billion_tokens": total / tokens * 1e9})
    return out
