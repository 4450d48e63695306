"""What the run loop says and records besides the step's metrics: the banner, a mixture's stages and
per-source figures, distillation's phases and autotune, stacking's growth."""

from __future__ import annotations

import io

from ruamel.yaml import YAML

from apr.checkpoint import names
from apr.evaluate.compare import Thresholds, compare_models, shard_batches
from apr.fmt import fmt_sci
from apr.fsutil import atomic_write_json, atomic_write_text
from apr.model.spec import param_count
from apr.track.protocol import NullRecorder
from apr.track.recorder import RunRecorder
from apr.train.csvlog import CsvLog, refuse_foreign_csv
from apr.train.outdir import RESOLVED_CONFIG, RESOLVED_CONFIG_HEADER
from apr.train.stop import Stop


def banner(run) -> str:
    c, tr = run.config, run.config.training
    params = param_count(c.model.architecture)
    what = f"resuming at step {run.start_step + 1}" if run.resumed_from else "starting"
    loader = run.loader
    epochs = run.total_steps / loader.steps_per_epoch
    return (f"apply: {what}; run {run.run_id} -> {run.run_dir}\n"
            f"  model {params / 1e6:.2f}M params; {run.engine.strategy.describe()}; "
            f"kernels {run.engine.backend.name}, {tr.mixed_precision} on {run.device}\n"
            f"  {run.total_steps:,} steps x {run.tokens_per_step:,} tokens = {epochs:.3g} epochs of "
            f"{loader.steps_per_epoch:,} steps ({loader.num_rows:,} sequences)"
            + (f"\n  mixture of {len(loader.names)} sources ({', '.join(loader.names)}) in "
               f"{len(loader.stages)} stage(s), stage {loader.stage_name!r} now" if run.mixture else ""))


def record_mixture(run, step: int, recorder) -> None:
    """A mixture's stage, tokens/rows/epochs per source and per-source val losses, recorded."""
    if not run.mixture:
        return
    figures = run.loader.figures()
    for name, value in (run.validation.by_source or {}).items():
        figures["sources"][name]["val_loss"] = value
    recorder.log_mixture(step, figures)


def stage_started(run, step: int, recorder) -> None:
    """A mixture's next stage draws its first rows at ``step``: an event and a line."""
    loader = run.loader
    st = loader.stages[loader.stage]
    total = sum(st.weights.values()) or 1.0
    mix = ", ".join(f"{n} {w / total:.0%}" for n, w in st.weights.items() if w > 0)
    message = f"data stage {loader.stage_name!r} starts at step {step}: {mix} of tokens"
    recorder.log_event("stage", step, message, {"stage": loader.stage, "name": loader.stage_name,
                                                "token_shares": {n: w / total for n, w in st.weights.items()}})
    run.echo(f"{run.step_label(step)}  {message}")


def distill_records(run, step: int, recorder) -> None:
    """Distillation: an event where a phase-1 block or phase 2 starts, where a block ends (why, its
    final loss), and the autotune's."""
    loss = run.engine.loss
    phase, block = loss.last_phase
    if loss.started:
        what = (f"phase 1: student block {block} learns teacher blocks "
                f"{loss.spans[block][0]}-{loss.spans[block][1] - 1}" if phase == 1
                else "phase 2: the whole student on KD + LM loss")
        recorder.log_event("distill", step, f"distillation {what} from step {step}", {"phase": phase, "block": block})
        run.echo(f"{run.step_label(step)}  distillation {what}")
    for kind, message, detail in loss.autotune.events:
        recorder.log_event(kind, step, message, detail)
        run.echo(f"{run.step_label(step)}  autotune: {message}")
    loss.autotune.events.clear()
    for kind, message, detail in loss.events:
        recorder.log_event(kind, step, message, detail)
        run.echo(f"{run.step_label(step)}  {message}")
    loss.events.clear()


def verified(run, recorder, stop: Stop) -> None:
    """Distillation's ``verify`` at the end of a finished run: student against teacher on the first
    batches of data.val (else data.train), as ``apr verify`` (apr/evaluate/compare.py); a ``verify``
    event whose detail is the table, ``verify.json`` in the output folder, and one line per row.
    Rank 0 of one process or DDP; not on shards (there the teacher comparison would need every rank)."""
    d = run.config.training.distill
    data = run.config.data.val or run.config.data.train
    if (stop.status != "finished" or run.engine.kind != "distill" or d is None or d.verify is None
            or (run.dp is not None and run.dp.rank != 0)):
        return
    if run.engine.sharded or not isinstance(data, str):
        run.warn("training.distill.verify: not run (sharded runs and mixtures are compared with apr verify)")
        return
    v = d.verify
    limits = Thresholds(v.attention.max_mean_l1, v.attention.max_max_l1, v.logits.max_mean_l1, v.logits.max_max_l1)
    batches = (b.to(run.device) for b in shard_batches(data, seq_len=run.config.data.seq_len,
                                                       batch_size=run.config.data.batch_size, batches=v.batches,
                                                       column=run.config.data.input_column))
    model = run.engine.model
    was_training = model.training
    model.eval()
    try:
        proj = run.engine.loss.projections  # a narrower student's (apr/train/distill.py)
        result = compare_models(run.engine.loss.teacher, model, batches, limits, d.block_map,
                                (proj[names.DISTILL_DOWN].detach(), proj[names.DISTILL_UP].detach()) if proj else None)
    finally:
        model.train(was_training)
    doc = {"step": run.step, **result.to_dict()}
    atomic_write_json(run.run_dir / "verify.json", doc)
    verdict = "within every threshold" if result.ok else "OUTSIDE a threshold"
    message = f"verify: student against teacher on {result.batches} batches: {verdict}"
    recorder.log_event("verify", run.step, message, doc)
    run.echo(message)
    for r in result.rows:
        run.echo(f"  {r.what}: mean L1 {fmt_sci(r.mean_l1)} (limit {fmt_sci(r.max_mean_l1)}), max L1 "
                 f"{fmt_sci(r.max_l1)} (limit {fmt_sci(r.max_max_l1)}) {'ok' if r.ok else 'FAIL'}")


def grown(run, step: int, old_depth: int, recorder) -> None:
    """Stacking's growth at ``step``: an event and a line."""
    st = run.config.model.stacking
    new_depth = len(run.engine.model.model.layers)
    message = (f"stacking stage {run.stack_stage} starts at step {step}: {old_depth} -> {new_depth} blocks "
               f"({st.init}{', prepended' if str(st.building_mode) == 'prepend' else ''}"
               f"{', earlier blocks frozen' if run.engine.frozen else ''})")
    recorder.log_event("stack", step, message, {"stage": run.stack_stage, "blocks": new_depth,
                                                "from_blocks": old_depth, "init": str(st.init),
                                                "building_mode": str(st.building_mode)})
    run.echo(f"{run.step_label(step)}  {message}")


def stage_label(run) -> str | None:
    """The run's stage for the evals panel: the mixture's stage and the stacking stage, where the run
    has them (None: one stage)."""
    parts = [run.loader.stage_name] if getattr(run, "mixture", False) and len(run.loader.stages) > 1 else []
    config = getattr(run, "config", None)
    if config is not None and config.model.stacking:  # progressive stacking: the stage's depth
        parts.append(f"stack {run.stack_stage}")
    return " / ".join(parts) or None


def tasks_and_samples(run, step: int, recorder):
    """evaluation.tasks / samples on the model in training (apr.evaluate.during_training); the new
    scores are recorded and checked by the alerts (``eval.<task>.acc`` conditions). Data parallel:
    rank 0 holds the whole model; shards: every rank gathers it and rank 0 records."""
    if run.dp is not None and run.dp.rank != 0 and not run.engine.sharded:
        return None
    with run.engine.whole_weights():
        result = run.evaluator.run(run.engine.model, step)
    if not run.is_main:
        return None
    recorder.log_task_evals(step, {**result, "stage": stage_label(run)})
    scores = "  ".join(f"{name} acc {s['acc']:.3f} acc_norm {s['acc_norm']:.3f}" for name, s in result["tasks"].items())
    run.echo(f"{run.step_label(step)}  eval {scores}  ({result['seconds']:.1f} s)".replace("  (", " (")
             if scores else f"{run.step_label(step)}  samples ({result['seconds']:.1f} s)")
    for sample in result["samples"]:
        run.echo(f"  sample: {sample['prompt']!r} -> {sample['text']!r}")
    return run.check_alerts({"step": step}, step, recorder) if result["tasks"] else None


def check_alerts(run, metrics: dict, step: int, recorder):
    """Print the alerts ``metrics`` fire; the first critical alert stops the run without a checkpoint
    of this step, else the first other ``stop`` alert (error) stops it after one."""
    fired = recorder.check_alerts(metrics)
    for alert in fired:
        run.echo(f"alert ({alert.severity}) at step {step}: {alert.message}")
    critical = [a for a in fired if getattr(a, "severity", None) == "critical"]
    if critical:
        return Stop.critical(critical[0].message)
    stops = [a for a in fired if a.action == "stop"]
    return Stop.alert(stops[0].message) if stops else None


def forked(run, recorder) -> None:
    """A fork's first record: the parent run and step it starts from (``apr runs show``'s ``parent``)."""
    parent = run.options.fork_of
    detail = {"parent": {"run_id": parent.get("run_id"), "step": int(parent["step"])},
              "parent_dir": parent.get("run_dir"), "overrides": dict(run.options.overrides or {})}
    recorder.log_event("fork", run.start_step, f"forked from run {parent.get('run_id')} at step {parent['step']}",
                       detail)
    run.echo(f"fork: run {recorder.run_id} starts from run {parent.get('run_id')}'s step {parent['step']}")


def open_recorder(run):
    """Rank 0 writes the run files (the resolved config, the plan) and records; the other ranks record
    nothing."""
    if not run.is_main:
        return NullRecorder(run.run_id)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    if run.config.monitoring.csv_log:  # a metrics.csv of the user's: refused before anything is written
        refuse_foreign_csv(run.run_dir)
    buf = io.StringIO()
    yaml = YAML()
    yaml.default_flow_style = False
    yaml.dump(run.config.model_dump(mode="json"), buf)
    atomic_write_text(run.run_dir / RESOLVED_CONFIG,
                      f"{RESOLVED_CONFIG_HEADER} (from {run.config_path}); hash {run.config_hash}\n" + buf.getvalue())
    if run.plan_doc is not None:
        atomic_write_json(run.run_dir / "plan.json", run.plan_doc)
    recorder = RunRecorder(run.run_dir, run.config, config_hash=run.config_hash, total_steps=run.total_steps,
                           tokens_per_step=run.tokens_per_step, run_id=run.run_id, apr_home=run.options.apr_home,
                           config_path=str(run.config_path), model_params=param_count(run.config.model.architecture),
                           plan=run.plan_doc,  # a resume of this run (not a fork): the events its checkpoint saw
                           events_after=run.checkpoints.events_mark if run.run_id is not None else None)
    return CsvLog(recorder, run.run_dir) if run.config.monitoring.csv_log else recorder  # metrics.csv


def validated_initially(run, recorder) -> None:
    """Step 0's validation loss (data.val, or a mixture's per-source val folders alone): a later
    checkpoint is "best" only if it beats the initial weights, and early stopping counts from them."""
    val = run.validation.initial(run.engine, recorder)
    if run.early_stopping is not None and val is not None:
        run.early_stopping.observe(0, val)
    record_mixture(run, 0, recorder)


def epochs_read(loader) -> float:
    """Epochs read so far, fractional."""
    return loader.epoch + loader.position / max(loader.micro_batches_per_epoch, 1)

