"""Build a Plan: load the config, derive facts from config + data + tokenizer, evaluate every contract.

``build_plan`` is what `apr train plan` renders and what `apr train apply` runs before training. It
never imports torch, never touches a GPU and writes nothing. Facts come from ``apr.plan.facts``
(numbers only); verdicts come from the contract files in ``contracts/`` (CEL rules).

``Plan.to_dict()`` is the one JSON object of `apr train plan --json` and of a plan file
(``-out plan.json``); its keys are documented in docs/plan.md and by ``PLAN_KEYS`` below.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from apr import __version__
from apr.checkpoint.manager import CheckpointError, read_info, scan
from apr.config import AprConfig, LoadedConfig, config_hash, load_config
from apr.data.mixconfig import decay_start_step
from apr.errors import AprError, Finding
from apr.launch import env_world_size
from apr.memory.table import MemoryRow, add_rows, coefficients_dict
from apr.plan import gpus
from apr.plan.clipadvice import exact_clip_findings
from apr.plan.contracts import SEVERITY_ORDER, ContractResult, evaluate_contracts, load_contracts
from apr.plan.customfacts import custom_findings
from apr.plan.datafacts import data_manifests, dataset_facts, fingerprint_entries, resolve, shared_shards
from apr.plan.distillfacts import distill_config_findings, distill_facts
from apr.plan.driftfacts import drift_check
from apr.plan.elastic import elastic_layout
from apr.plan.explain import layers_dict
from apr.plan.facts import all_facts
from apr.plan.fit import auto_budget, auto_line, fit_auto
from apr.plan.gpus import Target, UnknownGpuError, known_names, resolve_target
from apr.plan.initfacts import init_from_check
from apr.plan.mixfacts import (
    merged_train_facts,
    mixture_config_findings,
    mixture_facts,
    reads,
    source_contract_results,
    source_dataset_facts,
)
from apr.plan.mlafacts import mla_config_findings
from apr.plan.orchestratefacts import (
    orchestrator_facts,
    orchestrator_findings,
    orchestrator_memory_findings,
    orchestrator_memory_rows,
)
from apr.plan.reductionfacts import reduction_facts, reduction_findings
from apr.plan.statefacts import state_dtype_findings
from apr.plan.storage import storage_facts
from apr.plan.threadadvice import oversubscription_findings
from apr.plan.tokfacts import tokenizer_facts
from apr.plan.validate import (
    alert_config_findings,
    compile_findings,
    data_path_findings,
    early_stopping_findings,
    output_dir_findings,
    plan_checks,
    sharding_findings,
    sink_findings,
    stacking_findings,
    survival_findings,
)
from apr.steps.algebra import elastic_accumulation
from apr.steps.execution import Execution
from apr.steps.resolved import Resolved, laid_out
from apr.steps.resolved import resolve as resolve_run
from apr.track.names import PLAN_FORMAT
from apr.track.trackers import sink_target_findings

PLAN_FORMAT_VERSION = "1"

# Top-level keys of Plan.to_dict(), in order (docs/plan.md describes each).
PLAN_KEYS = ("format", "format_version", "apr_version", "created", "config_path", "cwd", "config_hash",
             "overrides", "layers", "world_size", "nodes", "target", "config", "run", "facts", "memory",
             "time_estimate", "mfu", "cost", "storage", "contracts", "findings", "summary", "data_fingerprint")

# Command-line overrides `apr train apply` may pass; bare names mean keys of the training section.
OVERRIDABLE = ("training.seed", "training.device", "training.max_steps")


class PlanUsageError(AprError):
    """A bad command-line argument to plan (unknown --gpu, unparsable --vram, --world-size < 1)."""

    exit_code = 2


@dataclass
class Plan:
    loaded: LoadedConfig
    config: AprConfig
    config_path: Path
    config_hash: str
    world_size: int
    target: Target | None
    target_args: dict  # {"gpu": ..., "vram": ...} as given on the command line
    overrides: dict
    facts: dict
    memory: list[MemoryRow]
    time_estimate: dict | None
    results: list[ContractResult]
    findings: list[Finding]
    data_fingerprint: dict
    nodes: int = 1
    created: float = field(default_factory=time.time)
    cwd: str = field(default_factory=os.getcwd)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "info"]

    @property
    def execution(self) -> dict:
        """Engine, device, kernel backend (``auto`` described), precision and clipping in force."""
        return self.facts["execution"]

    @property
    def kernels(self) -> str:
        return self.execution["kernels_resolved"]

    @property
    def resolved(self) -> Resolved:
        """What the trainer receives (apr/steps/resolved.py): this plan's config and choices, frozen.
        Its step counts are over the rows the plan counted in the data's footers."""
        layers = self.config.model.architecture.num_hidden_layers
        train = ((self.facts.get("data") or {}).get("train") or {})
        return resolve_run(self.config, world_size=self.world_size, nodes=self.nodes,
                           num_sequences=train.get("sequences"),
                           execution=Execution.from_dict(self.execution["policy"], layers),
                           decay_start_of=decay_start_step)

    def summary(self) -> dict:
        # An info contract whose rule is false is a note, not a failure: `failed` counts errors and warnings.
        noted = sum(r.status == "failed" and r.finding is not None and r.finding.severity == "info"
                    for r in self.results)
        count = {s: sum(r.status == s for r in self.results) for s in ("passed", "failed", "skipped")}
        count["failed"] -= noted
        return {**count, "noted": noted, "contracts": len(self.results), "errors": len(self.errors),
                "warnings": len(self.warnings), "info": len(self.infos)}

    def exit_code(self, strict: bool = False) -> int:
        """0 when no error finding (and, with ``strict``, no warning); else 1."""
        return 1 if self.errors or (strict and self.warnings) else 0

    def to_dict(self) -> dict:

        memory_total = sum(r.bytes for r in self.memory)
        doc: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "format_version": PLAN_FORMAT_VERSION,
            "apr_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "config_path": str(Path(os.path.abspath(self.config_path))),
            "cwd": self.cwd,
            "config_hash": self.config_hash,
            "overrides": dict(self.overrides),
            "layers": layers_dict(self.loaded),
            "world_size": self.world_size,
            "nodes": self.nodes,
            "target": target_dict(self.target, self.target_args),
            "config": self.config.model_dump(mode="json"),
            "run": run_summary(self),
            "facts": self.facts,
            "memory": {
                "rows": [r.to_dict() for r in self.memory],
                "total_bytes": memory_total,
                "vram_bytes": self.target.vram_bytes if self.target else None,
                "usage_fraction": (memory_total / self.target.vram_bytes
                                   if self.target and self.target.vram_bytes else None),
                "max_micro_batch": self.facts["memory"].get("max_micro_batch"),
                "coefficients": coefficients_dict(device=str(self.config.training.device)),
            },
            "time_estimate": self.time_estimate,
            "mfu": self.facts.get("mfu"),
            "cost": self.facts.get("cost"),
            "storage": self.facts.get("storage"),
            "contracts": [r.to_dict() for r in self.results],
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.summary(),
            "data_fingerprint": self.data_fingerprint,
        }
        return doc


def target_dict(target: Target | None, args: dict) -> dict:
    """The target as the plan file stores it: the command-line arguments (``gpu``, ``vram``, which
    apply passes back to build_plan) plus what they resolved to."""
    out: dict[str, Any] = {"gpu": args.get("gpu"), "vram": args.get("vram")}
    if target is None:
        return {**out, "name": None, "label": None, "vram_bytes": None, "source": None, "known": None}
    return {**out, "name": target.name, "label": target.gpu.label if target.gpu else None,
            "vram_bytes": target.vram_bytes, "source": target.source, "known": target.known,
            "assumed_mfu": target.gpu.mfu if target.gpu else None}


def run_summary(plan: Plan) -> dict:
    """The resolved run in a few numbers: what the text output's first section shows."""
    c, f = plan.config, plan.facts
    arch = c.model.architecture
    steps = f.get("steps") or {}
    return {
        "model": {"layers": arch.num_hidden_layers, "hidden_size": arch.hidden_size,
                  "heads": arch.num_attention_heads, "kv_heads": arch.kv_heads,
                  "head_dim": f["model"]["head_dim"], "intermediate_size": arch.intermediate_size,
                  "vocab_size": arch.vocab_size, "tied_embeddings": arch.tie_word_embeddings,
                  "params": f["model"]["params"], "non_embedding_params": f["model"]["non_embedding_params"]},
        "data": {"train": c.data.model_dump(mode="json")["train"], "val": c.data.val, "tokenizer": c.data.tokenizer,
                 "train_sequences": (f.get("data") or {}).get("train", {}).get("sequences"),
                 "seq_len": c.data.seq_len},
        "schedule": {"batch_size": c.data.batch_size, "gradient_accumulation": c.training.gradient_accumulation,
                     "world_size": plan.world_size, "epochs": c.training.epochs, "max_steps": c.training.max_steps,
                     "total_steps": steps.get("total_steps"), "warmup_steps": c.training.warmup_steps,
                     "lr_scheduler": str(c.training.lr_scheduler), "lr": c.optimizer.lr,
                     "min_lr": c.optimizer.resolved_min_lr, "total_tokens": steps.get("total_tokens")},
        "execution": plan.execution,
    }


# ----------------------------------------------------------------------------------- inputs


def normalise_overrides(overrides: dict | None) -> dict:
    """Command-line overrides as dotted keys: apply's named options (``max_steps``, ``seed``,
    ``device``: keys of the training section) and ``KEY.PATH=VALUE`` settings (already dotted). The
    config loader writes them in over the file (apr/config/layers.py), so each is checked like a file
    value and its findings say "command line"."""
    out = {}
    for key, value in (overrides or {}).items():
        if value is None and "." not in key:  # a named option not given; ``data.val=null`` is a setting
            continue
        dotted = key if "." in key else f"training.{key}"
        if "." not in key and dotted not in OVERRIDABLE:
            raise PlanUsageError(f"cannot override {key!r}; overridable: {', '.join(OVERRIDABLE)}")
        out[dotted] = value
    return out


def resolve_plan_target(config: AprConfig, gpu: str | None, vram: str | int | None) -> Target | None:
    """The memory/time target: --gpu / --vram, else training.gpu / training.vram. Bad arguments raise
    PlanUsageError (exit 2); an unknown name in the config is left to contract C-MEM-003."""
    tr = config.training
    try:
        target = resolve_target(gpu, vram, config_gpu=tr.gpu, config_vram=tr.vram)
        if vram is not None and target is not None and not target.vram_bytes:
            raise ValueError(f"expected a memory size above zero, got {vram!r}")
        if target is None and str(tr.device) in ("cpu", "auto"):  # a CPU run must fit in this machine's RAM

            if str(tr.device) == "cpu" or not gpus.cuda_device_present():  # auto runs on the CPU here
                target = gpus.host_target(str(tr.device))
        return target
    except UnknownGpuError as e:
        raise PlanUsageError(str(e), [Finding("error", "plan.unknown_gpu", str(e), path="--gpu",
                                              expected="one of " + ", ".join(known_names()), got=repr(gpu))]) from None
    except ValueError as e:
        raise PlanUsageError(f"--vram: {e}", [Finding("error", "plan.bad_vram", str(e), path="--vram",
                                                      expected="a size such as 24GiB or 80GB",
                                                      got=repr(vram))]) from None


def fingerprint_roots(config: AprConfig) -> list[dict]:
    """The inputs whose files make up the data fingerprint: train, val and tokenizer."""

    roots = ([("train", path) for _, path in config.data.train_paths()]
             + [("val", path) for _, path in config.data.val_paths()] + [("tokenizer", config.data.tokenizer)])
    return [{"role": role, "path": text, "resolved": str(resolve(text))} for role, text in roots if text is not None]


def data_fingerprint(config: AprConfig) -> dict:
    """Name, size, mtime and content digest of every file of the train and val datasets and the
    tokenizer. ``apply`` recomputes it and refuses a plan file whose fingerprint differs. The digest
    reads at most about 1.3 MiB per file (``apr.readers.content_digest``)."""

    roots = fingerprint_roots(config)
    files = []
    for root in roots:
        for entry in fingerprint_entries([Path(root["resolved"])]):
            files.append({"role": root["role"], **entry})
    digest = hashlib.sha256(json.dumps([[f["path"], f["size"], f["mtime_ns"], f["digest"]]
                                        for f in files]).encode()).hexdigest()
    return {"roots": roots, "files": files, "sha256": digest}


def resume_layout_findings(loaded, world_size: int) -> list[Finding]:
    """The newest checkpoint in ``training.output_dir`` was saved on another number of ranks: a
    ``--resume`` at ``world_size`` keeps its global batch by changing gradient_accumulation (info),
    or cannot (error naming both keys and the world sizes that can)."""
    config = loaded.config
    found = [e for e in scan(resolve(config.training.output_dir)) if e.complete]
    if not found:
        return []
    try:
        info = read_info(found[0].json_path)
        saved_tr, saved_data = info.config["training"], info.config["data"]
        w0, a0 = int(saved_tr.get("world_size", 1)), int(saved_tr.get("gradient_accumulation", 1))
        b0 = int(saved_data["batch_size"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return []  # apply --resume reports what is wrong with the checkpoint
    if w0 == world_size or b0 != config.data.batch_size:
        return []
    accum, valid = elastic_accumulation(w0, a0, world_size)
    file, line, column = loaded.source.where(("training", "world_size"))
    saved = f"{found[0].json_path.name} was saved by {w0} rank(s) x training.gradient_accumulation {a0}"
    if accum is None:
        message = (f"{saved} ({a0 * w0} micro-batches of {b0} sequences per step), which training.world_size "
                   f"{world_size} cannot split evenly: --resume would refuse; resume on "
                   f"{', '.join(map(str, valid))} ranks (or start over with --force)")
        return [Finding("error", "plan.resume_world_size", message, path="training.world_size", file=file,
                        line=line, column=column, expected=f"a world size dividing {a0 * w0}", got=str(world_size))]
    message = (f"{saved}: --resume on {world_size} ranks uses training.gradient_accumulation {accum}, keeping the "
               f"global batch of {a0 * w0 * b0} sequences")
    return [Finding("info", "plan.resume_world_size", message, path="training.world_size", file=file, line=line,
                    column=column)]


# ------------------------------------------------------------------------------------ build


def sharding_advice(loaded, facts: dict) -> list[Finding]:
    """A config that does not fit its target per rank as it is, but would under a sharding strategy."""
    sh, memory = facts.get("sharding"), facts.get("memory") or {}
    if not sh or not memory.get("vram_bytes") or memory["total_bytes"] <= memory["vram_bytes"]:
        return []
    fitting = [k for k in ("shard_grad_op", "hybrid", "full") if sh["fits"].get(k) and k != sh["strategy"]]
    if not fitting:
        return []
    best = fitting[0]
    gib = sh["per_rank_bytes"][best] / 2**30
    file, line, column = loaded.source.where(("training", "sharding"))
    message = (f"does not fit {memory['vram_bytes'] / 2**30:.1f} GiB per rank as configured "
               f"({memory['total_bytes'] / 2**30:.1f} GiB), but would with training.sharding: {best} "
               f"({gib:.1f} GiB per rank at {sh['world_size']} ranks)")
    return [Finding("warning", "plan.sharding", message, path="training.sharding", file=file, line=line,
                    column=column, expected=f"sharding {best}", got=sh["strategy"])]


def data_sequences(config: AprConfig) -> int | None:
    """The training rows the plan counts (the Parquet footers; a mixture's sources summed); None
    when the data is unreadable."""
    if config.data.sources is not None:
        train = merged_train_facts(source_dataset_facts(config, dataset_facts))
    else:
        train = dataset_facts(config.data.train, config.data.input_column)
    return train.get("sequences")


def resolve_config(config: AprConfig, *, world_size: int | None = None, nodes: int | None = None,
                   execution: Execution | None = None, elastic: dict | None = None,
                   data: bool = True, resume: str | None = None) -> Resolved:
    """The ``Resolved`` of a config for a caller without a saved plan (tests, lr-find, probe,
    profile, benchmarks): the plan's own resolution (``apr.steps.resolved.resolve``) over the rows
    the plan counts in the data; ``data=False``: an engine-only resolution, no data read. No
    memory budget: ``auto`` policies resolve as if memory were unlimited. ``resume``: the
    checkpoint the run resumes, whose world size may differ (an elastic resume, as apply plans it)."""
    if world_size is None:
        world_size = env_world_size() if env_world_size() > 1 else config.training.world_size
    if elastic is None and resume is not None:
        run_dir = Path(os.path.abspath(os.path.expanduser(config.training.output_dir)))
        elastic = elastic_layout(laid_out(config, world_size), run_dir, resume, world_size)
    return resolve_run(config, world_size=world_size, nodes=nodes or config.training.nodes,
                       num_sequences=data_sequences(config) if data else None, execution=execution,
                       elastic=elastic, decay_start_of=decay_start_step)


def build_plan(config_path: Path, *, gpu: str | None = None, vram: str | int | None = None,
               world_size: int | None = None, nodes: int | None = None, overrides: dict | None = None,
               contracts_dir: Path | None = None, device_budget=None) -> Plan:
    """Plan a run from ``config_path`` (``plan_config`` describes the arguments). A config whose layout
    keys say ``auto`` (apr/config/auto.py) is planned at their stand-ins, fitted (apr/plan/fit.py
    ``fit_auto``: raises FitError when nothing fits), and planned again at the fitted values, which the
    plan records in ``facts.fitted`` (an info finding says what was chosen and why): ``Plan.resolved``
    and a saved plan carry them, so apply runs what was fitted."""
    args = {"gpu": gpu, "vram": vram, "world_size": world_size, "nodes": nodes, "contracts_dir": contracts_dir,
            "device_budget": device_budget}
    plan = plan_config(config_path, overrides=overrides, **args)
    autos = plan.loaded.auto
    if not autos:
        return plan
    tr = plan.config.training  # the stand-ins keep data.global_batch_size at the ranks planned for
    ranks = {key: value for key, value, stated in (("training.world_size", plan.world_size, tr.world_size),
                                                   ("training.nodes", plan.nodes, tr.nodes)) if value != stated}
    if ranks:
        plan = plan_config(config_path, overrides={**(overrides or {}), **ranks}, **args)
    budget = (device_budget(plan.config) if device_budget is not None
              and (plan.target is None or not plan.target.vram_bytes) else None)
    keys, record = fit_auto(replace(plan, target=auto_budget(plan.target, budget)), autos)
    keys = record["keys"] = {**ranks, **keys}
    fitted = plan_config(config_path, overrides={**(overrides or {}), **keys}, **args)
    fitted.overrides = user = normalise_overrides(overrides)  # a saved plan's fitted keys are in facts.fitted
    fitted.facts["fitted"] = record

    def in_file(f: Finding) -> Finding:  # a fitted key is the file's auto, not a command-line setting
        if f.path not in autos or f.path in user:
            return f
        file, line, column = plan.loaded.source.where(tuple(f.path.split(".")))
        return replace(f, file=file, line=line, column=column)

    found = in_file(Finding("info", "plan.auto_fit", auto_line(record), path=autos[0]))
    fitted.findings = sorted([*map(in_file, fitted.findings), found], key=lambda f: SEVERITY_ORDER.get(f.severity, 3))
    return fitted


def plan_config(config_path: Path, *, gpu: str | None = None, vram: str | int | None = None,
                world_size: int | None = None, nodes: int | None = None, overrides: dict | None = None,
                contracts_dir: Path | None = None, device_budget=None) -> Plan:
    """Plan a run from ``config_path`` as it stands (``auto`` keys at their stand-ins).

    ``gpu``/``vram``: the target for the memory budget and time estimate (default: the config's
    training.gpu / training.vram, else none). ``world_size``: data-parallel processes (default:
    training.world_size); ``nodes``: the hosts they run on (default: training.nodes).
    ``overrides``: the command line's (``max_steps``, ``seed``, ``device`` from apply's options, and
    any ``KEY.PATH=VALUE`` setting as ``{"optimizer.lr": 0.001}``).
    ``device_budget``: apply's ``config -> (bytes, source)``, the device's memory the
    execution policy must fit when no target is given. Raises ConfigError when the config does not
    load, PlanUsageError (exit code 2) for a bad argument, ContractFileError for a malformed contract
    file.
    """

    config_path = Path(config_path)
    loaded = load_config(config_path, normalise_overrides(overrides))
    config = loaded.config

    bad_paths = data_path_findings(loaded)
    if bad_paths:  # before any fact: the data facts and the fingerprint walk every file under the folder
        raise AprError(f"{config_path}: {bad_paths[0].message}", bad_paths)
    if world_size is None:
        world_size = config.training.world_size
    if world_size < 1:
        raise PlanUsageError(f"--world-size must be at least 1, got {world_size}")
    if nodes is None:  # --nodes (typer: at least 1), else training.nodes (the schema: positive)
        nodes = config.training.nodes
    target = resolve_plan_target(config, gpu, vram)
    budget = device_budget(config) if device_budget is not None and (target is None or not target.vram_bytes) else None
    sheet = all_facts(config, world_size=world_size, nodes=nodes, target=target, device_budget=budget)

    init_facts, init_findings = init_from_check(loaded)
    if init_facts is not None:
        sheet.facts["init_from"] = init_facts
        if config.data.tokenizer is None and init_facts["tokenizer"]:

            sheet.facts["tokenizer"] = tokenizer_facts(init_facts["tokenizer"], data_manifests(config.data))
    contract_set = load_contracts(contracts_dir)
    contracts = contract_set.contracts
    mixture_findings: list[Finding] = mixture_config_findings(loaded)
    if config.data.sources is not None:  # the data contracts once per source, at data.train[i]
        mixture_findings += source_contract_results(
            [c for c in contracts if reads(c, "train") and c.path != "model.architecture.vocab_size"],
            loaded, sheet.facts, dataset_facts, shared_shards, evaluate_contracts)
        contracts = [c for c in contracts if not reads(c, "train") or c.path == "model.architecture.vocab_size"]
        if any(s.val for s in config.data.sources):  # validation is configured, per source
            contracts = [c for c in contracts if c.id != "C-DATA-020"]
        mixture, found = mixture_facts(loaded, sheet.facts, world_size)
        mixture_findings += found
        if mixture is not None:
            sheet.facts["mixture"] = mixture
    data_drift, found = drift_check(loaded)
    mixture_findings += found
    if data_drift:
        sheet.facts["data_drift"] = data_drift
    mixture_findings += distill_config_findings(loaded) + mla_config_findings(loaded)
    distilled, rows, found = distill_facts(loaded, sheet.facts, (sheet.facts.get("steps") or {}).get("total_steps"),
                                           target, world_size)
    mixture_findings += found
    if distilled is not None:  # the teacher and phase 2's logits are on the device too
        sheet.facts["distill"] = distilled
        sheet.memory = [*sheet.memory, *rows]
        add_rows(sheet.facts["memory"], rows)
        if sheet.time_estimate is not None and distilled["estimated_seconds"] is not None:
            sheet.time_estimate["distill_seconds"] = distilled["estimated_seconds"]
            sheet.time_estimate["estimated_seconds"] = distilled["estimated_seconds"] + (
                sheet.time_estimate.get("evaluation") or {}).get("estimated_seconds", 0.0)
            sheet.facts["time"]["estimated_seconds"] = sheet.time_estimate["estimated_seconds"]
        if distilled["loss_tensors"] and "storage" in sheet.facts:  # checkpoints hold the projections too
            sheet.facts["storage"] = storage_facts(
                config, (sheet.facts.get("steps") or {}).get("total_steps"),
                (sheet.time_estimate or {}).get("estimated_seconds"), world_size, distilled["loss_tensors"])
    total_steps = (sheet.facts.get("steps") or {}).get("total_steps")
    orchestrated = orchestrator_facts(config, total_steps, sheet.facts.get("memory"))
    if orchestrated is not None:  # the branches' extra steps and state copies (docs/training.md)
        sheet.facts["orchestrator"] = orchestrated
        rows = orchestrator_memory_rows(orchestrated, sheet.facts.get("memory"))
        sheet.memory = [*sheet.memory, *rows]
        memory = sheet.facts.get("memory")
        if memory and rows:
            add_rows(memory, rows)
        mixture_findings += orchestrator_memory_findings(loaded, orchestrated, memory)
        if sheet.time_estimate is not None and sheet.time_estimate.get("estimated_seconds") is not None:
            evaluation_s = (sheet.time_estimate.get("evaluation") or {}).get("estimated_seconds", 0.0)
            extra = (sheet.time_estimate["estimated_seconds"] - evaluation_s) * orchestrated["extra_fraction"]
            orchestrated["extra_seconds"] = extra
            sheet.time_estimate["estimated_seconds"] += extra
            sheet.facts.setdefault("time", {})["estimated_seconds"] = sheet.time_estimate["estimated_seconds"]
    mixture_findings += orchestrator_findings(loaded, total_steps)
    mixture_findings += reduction_findings(loaded, world_size)
    reduction = reduction_facts(config, world_size)  # canonical: its memory, traffic and time per step
    if reduction is not None:
        sheet.facts["reduction"] = reduction
    mixture_findings += custom_findings(loaded)  # training.mode custom: the targets column in every shard
    mixture_findings += state_dtype_findings(loaded)
    mixture_findings += plan_checks(loaded)  # validate's checks the plan has no fuller version of
    results = evaluate_contracts(contracts, config.model_dump(mode="json"), sheet.facts, loaded.source)

    findings = sorted([*(r.finding for r in results if r.finding is not None), *alert_config_findings(loaded),
                       *output_dir_findings(loaded), *init_findings, *compile_findings(loaded),
                       *sink_findings(loaded), *sink_target_findings(loaded), *mixture_findings,
                       *early_stopping_findings(loaded, (sheet.facts.get("steps") or {}).get("total_steps")),
                       *survival_findings(loaded, (sheet.facts.get("steps") or {}).get("total_steps")),
                       *stacking_findings(loaded, (sheet.facts.get("steps") or {}).get("total_steps")),
                       *sharding_findings(loaded, world_size, nodes), *sharding_advice(loaded, sheet.facts),
                       *exact_clip_findings(loaded, Execution.from_dict(sheet.facts["execution"]["policy"],
                                                                        config.model.architecture.num_hidden_layers)),
                       *resume_layout_findings(loaded, world_size),
                       *oversubscription_findings(loaded, sheet.facts["threads"])],
                      key=lambda f: SEVERITY_ORDER.get(f.severity, 3))
    return Plan(
        loaded=loaded, config=config, config_path=config_path, config_hash=config_hash(config),
        world_size=world_size, nodes=nodes, target=target, target_args={"gpu": gpu, "vram": vram},
        overrides=normalise_overrides(overrides), facts=sheet.facts, memory=sheet.memory,
        time_estimate=sheet.time_estimate, results=results, findings=findings,
        data_fingerprint=data_fingerprint(config))
