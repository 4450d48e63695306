"""Config-only checks used by `apr train validate`. Must stay free of torch, pyarrow and tokenizers.

The contracts whose ``needs`` is only ``config`` are evaluated over the facts that follow from the
config alone (model shapes, the memory budget against training.gpu / training.vram, the execution
strategy): the same contracts, facts and messages `apr train plan` shows, without reading data.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from importlib.util import find_spec

from apr.config import LoadedConfig
from apr.config.layers import key_loc
from apr.config.paths import data_path_problems, output_dir_problems, train_val_problems
from apr.errors import Finding
from apr.model import spec
from apr.plan.configfacts import base_facts, config_facts
from apr.plan.contracts import SEVERITY_ORDER, evaluate_contracts, load_contracts
from apr.plan.gpus import resolve_target
from apr.plan.orchestratefacts import orchestrator_findings
from apr.plan.reductionfacts import reduction_findings
from apr.steps import stacking
from apr.steps.execution import compile_problem
from apr.track.alerts import alert_findings


def config_findings(loaded: LoadedConfig, *, include_info: bool = False,
                    tainted: frozenset[tuple] = frozenset()) -> list[Finding]:
    """Findings of every config-only contract and check, errors first. Info findings (observations
    such as "no target GPU") are left out unless ``include_info``: validate reports problems only.

    ``tainted``: key paths whose value failed the schema and was replaced (apr.config.loader.
    load_config_partial); a contract or check that reads one of them is not run, the others are, so
    that one round reports the schema errors and every problem that can be known beside them."""

    config = loaded.config
    tr = config.training
    contracts = [c for c in load_contracts().contracts if c.config_only and not _reads_tainted(c, tainted)]
    facts: dict = {}
    target = resolve_target(None, None, config_gpu=tr.gpu, config_vram=tr.vram)
    try:
        if target is None:  # no memory budget: the memory, execution and target contracts are all skipped
            facts = base_facts(config, tr.world_size)
            contracts = [c for c in contracts if set(_FACT_REF.findall(_contract_text(c))) <= set(facts)]
        elif any("facts." in _contract_text(c) for c in contracts):
            facts = config_facts(config, world_size=tr.world_size, target=target).facts
    except Exception:  # noqa: BLE001 - placeholders need not make a computable model
        if not tainted:
            raise
        contracts = [c for c in contracts if "facts." not in _contract_text(c)]
    results = evaluate_contracts(contracts, config.model_dump(mode="json"), facts, loaded.source)
    findings = [r.finding for r in results if r.finding is not None
                and (include_info or r.finding.severity != "info")]
    for check, reads, _plan in _CHECKS:
        if not any(_related(loc, key) for loc in tainted for key in reads):
            findings += check(loaded)
    return sorted(findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 3))


def _related(a: tuple, b: tuple) -> bool:
    """One key path is the other or lies under it."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


_CONFIG_REF = re.compile(r"\bconfig\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
_FACT_REF = re.compile(r"\bfacts\.([A-Za-z_][A-Za-z0-9_]*)")
# The config keys each family of config facts (apr/plan/configfacts.py) is computed from; any other
# fact (memory, execution, sharding, MFU) reads the whole run.
_FACT_INPUTS: dict[str, tuple[tuple, ...]] = {
    "model": (("model",), ("data", "seq_len")),
    "target": (("training", "gpu"), ("training", "vram"), ("training", "mixed_precision")),
}
_WHOLE_RUN = (("model",), ("data",), ("optimizer",), ("training",))


def _contract_text(contract) -> str:
    return " ".join(filter(None, (contract.rule, contract.when, contract.message, contract.expected, contract.got,
                                  *contract.requires)))


def _reads_tainted(contract, tainted: frozenset[tuple]) -> bool:
    if not tainted:
        return False
    text = _contract_text(contract)
    reads = [tuple(ref.split(".")) for ref in _CONFIG_REF.findall(text)]
    for fact in set(_FACT_REF.findall(text)):
        reads += _FACT_INPUTS.get(fact, _WHOLE_RUN)
    return any(_related(loc, key) for loc in tainted for key in reads)


def alert_config_findings(loaded: LoadedConfig) -> list[Finding]:
    """`monitoring.alerts` conditions that apply would reject (CEL syntax, unknown metric, not a
    boolean), located at their line: caught by validate and plan instead of at the start of a run."""

    out = []
    monitoring = loaded.config.monitoring
    drift_off = ("monitoring.data_drift.interval is 0" if not monitoring.data_drift.interval else
                 "data.train is a mixture, whose rows ahead are not checked" if loaded.config.data.sources else None)
    for f in alert_findings(list(monitoring.alerts), file=str(loaded.path), block_norms=monitoring.block_norms,
                            data_drift_off=drift_off):
        index = int(f.path.split("[", 1)[1].split("]", 1)[0]) if "[" in f.path else None
        line = column = None
        if index is not None:
            file, line, column = loaded.source.where(("monitoring", "alerts", index, "condition"))
            f = replace(f, file=file)
        out.append(replace(f, line=line, column=column))
    return out


def _mixture_findings(loaded: LoadedConfig) -> list[Finding]:
    """``mixture_config_findings`` where the config has mixture keys at all."""
    data, tr = loaded.config.data, loaded.config.training
    if data.sources is None and not data.stages and not tr.decay_stage:
        return []
    from apr.plan.mixfacts import mixture_config_findings  # lazy: the data mixture modules, only for a mixture

    return mixture_config_findings(loaded)


def _distill_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.distillfacts.distill_config_findings`` where the config names distillation at all."""
    tr = loaded.config.training
    if str(tr.mode) != "distill" and tr.distill is None:
        return []
    from apr.plan.distillfacts import distill_config_findings  # lazy: the plan's facts, only for distillation

    return distill_config_findings(loaded)


def _mlm_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.mlmfacts.mlm_config_findings`` where the config names the masked-LM objective at all."""
    tr = loaded.config.training
    if str(tr.mode) != "mlm" and tr.mlm is None:
        return []
    from apr.plan.mlmfacts import mlm_config_findings  # lazy: off validate's path unless the objective is mlm

    return mlm_config_findings(loaded)


def _mla_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.mlafacts.mla_config_findings`` where the model has latent attention at all."""
    if loaded.config.model.architecture.mla is None:
        return []
    from apr.plan.mlafacts import mla_config_findings  # lazy: off validate's path unless the attention is mla

    return mla_config_findings(loaded)


def _state_dtype_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.statefacts.state_dtype_findings`` where the config stores its state in bf16."""
    if str(loaded.config.training.state_dtype) == "fp32":
        return []
    from apr.plan.statefacts import state_dtype_findings  # lazy: off validate's path unless training.state_dtype

    return state_dtype_findings(loaded)


def _moe_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.moefacts.moe_config_findings`` where the model has a mixture of experts."""
    if loaded.config.model.architecture.moe is None:
        return []
    from apr.plan.moefacts import moe_config_findings  # lazy: off validate's path unless the model has experts

    return moe_config_findings(loaded)


def _time_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.timefacts.time_config_findings`` where the model has time conditioning."""
    if loaded.config.model.architecture.time is None:
        return []
    from apr.plan.timefacts import time_config_findings  # lazy: off validate's path unless the model has time

    return time_config_findings(loaded)


def _custom_findings(loaded: LoadedConfig) -> list[Finding]:
    """``apr.plan.customfacts.custom_config_findings`` where the config names the custom objective."""
    tr = loaded.config.training
    if str(tr.mode) != "custom" and tr.custom is None:
        return []
    from apr.plan.customfacts import custom_config_findings  # lazy: off validate's path unless the objective is custom

    return custom_config_findings(loaded)


def output_dir_findings(loaded: LoadedConfig) -> list[Finding]:
    """`training.output_dir` a run must not write into (a filesystem root, the home folder, the data or
    the tokenizer), located at the key's line."""

    file, line, column = loaded.source.where(("training", "output_dir"))
    return [Finding("error", "config.output_dir", message, path="training.output_dir", file=file,
                    line=line, column=column, expected="a folder of the run's own, apart from its data", got=got)
            for message, got in output_dir_problems(loaded.config)]


def data_path_findings(loaded: LoadedConfig) -> list[Finding]:
    """`data.train` / `data.val` that cannot be right, at the key's line: a filesystem root or the
    home folder; validation data that is (or holds, or lies inside) training data once paths are
    resolved (the message names both keys; the plan's C-DATA-015 also finds copied shards)."""

    out = []
    for key, message, got in data_path_problems(loaded.config):
        file, line, column = loaded.source.where(key_loc(key))
        out.append(Finding("error", "config.data_path", message, path=key, file=file, line=line,
                           column=column, expected="a folder of pretokenized shards (or one shard)", got=got))
    for val_key, train_key, message, got in train_val_problems(loaded.config):
        file, line, column = loaded.source.where(key_loc(val_key))
        out.append(Finding("error", "config.val_is_train", message, path=val_key, file=file, line=line,
                           column=column, expected=f"validation data apart from {train_key}", got=got))
    return out


def compile_findings(loaded: LoadedConfig) -> list[Finding]:
    """`training.execution.compile: true` on a device this machine cannot compile for (no C++
    compiler for the CPU: an error; no Triton for CUDA: a warning, since another machine may apply)."""

    tr = loaded.config.training
    device = str(tr.device)
    if tr.execution.compile is not True or device not in ("cpu", "cuda"):
        return []  # device auto: known at apply start, which refuses before any step
    problem = compile_problem(device)
    if problem is None:
        return []
    file, line, column = loaded.source.where(("training", "execution", "compile"))
    severity = "error" if device == "cpu" else "warning"
    return [Finding(severity, "config.compile", f"training.execution.compile: {problem}; set it to false "
                    "(or auto: compiled only where the toolchain works and it pays)",
                    path="training.execution.compile", file=file, line=line, column=column,
                    expected=f"a working torch.compile toolchain for {device}", got=problem)]


def sink_findings(loaded: LoadedConfig) -> list[Finding]:
    """`monitoring.sinks` whose tracker package is not installed (an error: the run would record
    nowhere the user asked), at the sink's line, naming the extra that installs it."""
    sinks = loaded.config.monitoring.sinks
    if not sinks:
        return []
    from apr.track.trackers import EXTRA, missing_package  # lazy: the tracker adapters, only with sinks

    out = []
    for i, sink in enumerate(sinks):
        package = missing_package(str(sink.type))
        if package is None:
            continue
        file, line, column = loaded.source.where(("monitoring", "sinks", i, "type"))
        out.append(Finding("error", "config.sink_package", f"the {sink.type} sink needs the '{package}' package, "
                           f"which is not installed: pip install 'apr[{EXTRA}]'", path=f"monitoring.sinks[{i}].type",
                           file=file, line=line, column=column, expected=f"'{package}' importable",
                           got="not installed"))
    return out


def _sink_target_findings(loaded: LoadedConfig) -> list[Finding]:
    """Sinks aimed at apr's own stores, records or the data (apr/track/trackers.py)."""
    if not loaded.config.monitoring.sinks:
        return []
    from apr.track.trackers import sink_target_findings  # lazy: the tracker adapters, only with sinks

    return sink_target_findings(loaded)


def warmup_findings(loaded: LoadedConfig) -> list[Finding]:
    """C-TRAINCFG-004 (warmup above 10% of the run) where the config alone decides it: with
    ``training.max_steps`` in the file the run has at most that many steps (the data may cap it
    lower, which only raises the share), so the same contract the plan evaluates over the data's
    step count is evaluated here over ``max_steps``: the same message and location."""
    tr = loaded.config.training
    if not tr.max_steps or not tr.warmup_steps or tr.warmup_steps / tr.max_steps <= 0.10:
        return []
    contract = next((c for c in load_contracts().contracts if c.id == "C-TRAINCFG-004"), None)
    if contract is None:
        return []
    facts = {"steps": {"total_steps": tr.max_steps, "warmup_fraction": tr.warmup_steps / tr.max_steps}}
    results = evaluate_contracts([contract], loaded.config.model_dump(mode="json"), facts, loaded.source)
    return [r.finding for r in results if r.finding is not None]


def early_stopping_findings(loaded: LoadedConfig, total_steps: int | None) -> list[Finding]:
    """`training.early_stopping.patience` set where it cannot act: no validation (no data.val, or
    training.eval_interval 0), or more validations than the run has (``total_steps``; validate knows
    it only from training.max_steps, the plan from the data)."""

    config = loaded.config
    tr = config.training
    patience = tr.early_stopping.patience
    if not patience:
        return []
    key = ("training", "early_stopping", "patience")
    file, line, column = loaded.source.where(key)
    where = {"path": ".".join(key), "file": file, "line": line, "column": column}
    if config.data.val is None or tr.eval_interval == 0:
        got = "no data.val" if config.data.val is None else "training.eval_interval: 0"
        return [Finding("error", "config.early_stopping", "early stopping needs validation during "
                        f"training ({got}): set data.val and training.eval_interval, or patience: null",
                        expected="data.val and training.eval_interval > 0", got=got, **where)]
    if total_steps is None:
        return []
    validations = total_steps // tr.eval_interval + (1 if total_steps % tr.eval_interval else 0)
    if patience > validations:
        return [Finding("error", "config.early_stopping", f"patience {patience} is longer "
                        f"than the run: {total_steps} steps validate {validations} times (every "
                        f"{tr.eval_interval}); early stopping could never act",
                        expected=f"patience <= {validations}", got=str(patience), **where)]
    return []


def survival_findings(loaded: LoadedConfig, total_steps: int | None) -> list[Finding]:
    """`training.rollback` / `training.bad_steps` set where they can never act: a rollback needs a
    checkpoint before the spike (a save_interval shorter than the run) and a patience shorter than
    the run; a test needs its history (min_history) before the run ends. ``total_steps`` as for
    ``early_stopping_findings``."""

    tr = loaded.config.training
    rb, bs = tr.rollback, tr.bad_steps
    out = []

    def finding(key: tuple, message: str, expected: str, got: str, severity: str = "error") -> None:
        file, line, column = loaded.source.where(key)
        out.append(Finding(severity, "config.rollback" if key[1] == "rollback" else "config.bad_steps", message,
                           path=".".join(key), file=file, line=line, column=column, expected=expected, got=got))

    if total_steps is None:
        return out
    if rb.threshold is not None:
        if tr.save_interval >= total_steps:
            finding(("training", "rollback", "threshold"),
                    f"rollback needs a checkpoint to roll back to, but training.save_interval {tr.save_interval} "
                    f"writes none before the end of the {total_steps}-step run",
                    f"training.save_interval < {total_steps}", str(tr.save_interval))
        if rb.patience >= total_steps:
            finding(("training", "rollback", "patience"),
                    f"patience {rb.patience} is not shorter than the run ({total_steps} steps): a rollback "
                    "could never trigger", f"patience < {total_steps}", str(rb.patience))
        elif rb.min_history + rb.patience > total_steps:
            finding(("training", "rollback", "min_history"),
                    f"min_history {rb.min_history} + patience {rb.patience} exceed the run's {total_steps} steps: "
                    "spikes are never tested", f"min_history + patience <= {total_steps}", str(rb.min_history),
                    "warning")
    if (bs.loss_z is not None or bs.grad_norm_z is not None) and bs.min_history >= total_steps:
        finding(("training", "bad_steps", "min_history"),
                f"min_history {bs.min_history} is not shorter than the run ({total_steps} steps): no step is ever "
                "tested", f"min_history < {total_steps}", str(bs.min_history), "warning")
    return out


def stacking_findings(loaded: LoadedConfig, total_steps: int | None) -> list[Finding]:
    """`model.stacking` that cannot run: a stage that shrinks the model or does not grow it, a last
    stage that is not the model's depth, a stage without steps before the last, stacking with
    init_from (its weights have the full depth), model.lora and trunk_lora that differ, interpolate with freeze or with
    prepend; with the
    run's ``total_steps``: a stage that would never start."""

    config = loaded.config
    st = config.model.stacking
    if st is None:
        return []
    out = []

    def finding(key: tuple, message: str, expected: str, got: str, severity: str = "error") -> None:
        file, line, column = loaded.source.where(key)
        path = ".".join(f"[{k}]" if isinstance(k, int) else k for k in key).replace(".[", "[")
        out.append(Finding(severity, "config.stacking", message, path=path, file=file, line=line, column=column,
                           expected=expected, got=got))

    depth = config.model.architecture.num_hidden_layers
    for i, stage in enumerate(st.stages):
        if i and stage.blocks <= st.stages[i - 1].blocks:
            finding(("model", "stacking", "stages", i, "blocks"),
                    f"stage {i} has {stage.blocks} blocks, not more than stage {i - 1}'s {st.stages[i - 1].blocks}: "
                    "stacking only grows the model", f"more than {st.stages[i - 1].blocks}", str(stage.blocks))
        if stage.steps is None and i < len(st.stages) - 1:
            finding(("model", "stacking", "stages", i, "steps"), f"stage {i} has no steps; only the last stage "
                    "runs to the end of the run", "a step count", "none")
    if st.stages and st.stages[-1].blocks != depth:
        finding(("model", "stacking", "stages", len(st.stages) - 1, "blocks"),
                f"the last stage has {st.stages[-1].blocks} blocks, but model.architecture.num_hidden_layers is "
                f"{depth}: the last stage trains the configured model", str(depth), str(st.stages[-1].blocks))
    if not st.stages:
        finding(("model", "stacking", "stages"), "model.stacking lists no stage", "at least one stage", "[]")
    if config.model.lora is not None:  # left there by the schema only when trunk_lora differs
        finding(("model", "lora"), "model.lora and model.stacking.trunk_lora both set the adapters of a stacked "
                "run's trunk, with different values", "one of model.lora and model.stacking.trunk_lora",
                "both, different")
    if config.model.init_from is not None:
        finding(("model", "init_from"), "model.stacking cannot be combined with model.init_from (its weights have "
                "the model's full depth; a stacked run starts from its first stage's random init)",
                "model.init_from: null, or no stacking", "model.init_from set")
    out += _trunk_findings(config, finding)
    if str(st.init) == "interpolate" and str(st.earlier) == "freeze":
        finding(("model", "stacking", "earlier"), "earlier: freeze needs the earlier blocks to keep their places; "
                "init: interpolate moves them", "init copy_top or fresh with freeze", "interpolate + freeze")
    if str(st.init) == "interpolate" and str(st.building_mode) == "prepend":
        finding(("model", "stacking", "building_mode"), "building_mode: prepend puts a new stack below the existing "
                "blocks; init: interpolate spreads copies of every block through the model, so there is no new "
                "stack to place", "init copy_top or fresh with prepend", "interpolate + prepend")
    if total_steps is not None and len(st.stages) > 1:
        at = 0
        for i, stage in enumerate(st.stages[:-1]):
            at += stage.steps or 0
            if at >= total_steps:
                finding(("model", "stacking", "stages", i, "steps"),
                        f"stages 0-{i} take {at} steps, but the run has {total_steps}: stage {i + 1} would never start",
                        f"fewer than {total_steps} steps before the last stage", str(at))
                break
    return out


def _stage_adapter_findings(config, lora, finding) -> None:
    """``adapter_pattern`` and ``stages[].adapters`` (docs/training.md, "Progressive stacking"): they
    need trunk adapters, never name the last stage (its blocks never join the trunk), and give every
    stage's blocks a rank from 1 to the layer's narrow side."""
    st, arch = config.model.stacking, config.model.architecture
    own = {i: ("model", "stacking", "stages", i, "adapters") for i, s in enumerate(st.stages) if s.adapters}
    keys = ([("model", "stacking", "adapter_pattern")] if st.adapter_pattern is not None else []) + list(own.values())
    if not keys:
        return
    if lora is None:
        for key in keys:
            finding(key, f"{'.'.join(str(k) for k in key[2:])} sets the rank and alpha of the trunk's adapters; this "
                    "trunk has no adapters", "trunk_lora, model.lora or trunk_strategy qlora (with earlier: freeze)",
                    "no trunk adapters")
        return
    last = len(st.stages) - 1
    if last in own:
        finding(own[last], f"stage {last} is the last: its blocks never join the trunk, so they never carry "
                "trunk adapters", "adapters on an earlier stage", f"stages[{last}].adapters")
    smallest = min((min(spec.linear_dims(arch, m)), m) for m in lora.modules)
    for i in range(last):
        rank, _ = stacking.stage_adapters(config, i, floor=False)
        if rank == lora.rank:  # the trunk adapters' own rank, checked above
            continue
        set_here = st.stages[i].adapters is not None and st.stages[i].adapters.rank is not None
        key = (*own[i], "rank") if set_here else ("model", "stacking", "adapter_pattern", "rank")
        if rank < 1:
            finding(key, f"the blocks stage {i} adds would carry adapters of rank {rank} ({lora.rank} halved {i} "
                    "times)", "a rank of at least 1: a larger trunk rank, fewer stages or another pattern", str(rank))
        elif rank > smallest[0]:
            finding(key, f"the blocks stage {i} adds would carry adapters of rank {rank}, larger than the layer: "
                    f"{smallest[1]} has {smallest[0]} features on its narrow side", f"at most {smallest[0]}",
                    str(rank))


def _trunk_findings(config, finding) -> list[Finding]:
    """A stacking trunk that cannot be stored or adapted as configured (docs/design.md, "StackWise
    progressive stacks"); reported through ``finding`` (so this returns nothing of its own)."""
    st = config.model.stacking
    arch = config.model.architecture
    qlora = str(st.trunk_strategy) == "qlora"
    for i, stage in enumerate(st.stages):
        if str(stage.precision) == "nvfp4":
            finding(("model", "stacking", "stages", i, "precision"), "nvfp4 needs Blackwell tensor cores (compute "
                    "capability 10.0) and an NVFP4 trunk path; apr has neither on any device it runs on, so the "
                    "stage cannot be stored in it", "fp32, fp16, bf16 or nf4", "nvfp4")
        elif qlora and str(stage.precision) != "fp32":
            finding(("model", "stacking", "stages", i, "precision"), "trunk_strategy qlora stores every earlier "
                    f"block in nf4; stage {i}'s precision {stage.precision} contradicts it", "fp32 (the default)",
                    str(stage.precision))
    lora_key = st._trunk_lora_key  # model.lora or model.stacking.trunk_lora, as the user wrote it
    wants_trunk = [(("model", "stacking", "trunk_strategy"), "trunk_strategy qlora") if qlora else None,
                   (lora_key, ".".join(lora_key)) if st.trunk_lora is not None else None]
    wants_trunk += [(("model", "stacking", "stages", i, "precision"), f"stages[{i}].precision {stage.precision}")
                    for i, stage in enumerate(st.stages[:-1]) if str(stage.precision) not in ("fp32", "nvfp4")]
    for key, what in filter(None, wants_trunk):
        if str(st.earlier) != "freeze":
            finding(key, f"{what} stores or adapts frozen earlier blocks, but earlier: train updates them in full "
                    "(AdamW cannot step a 4-bit or half-precision master weight)", "earlier: freeze",
                    f"earlier: {st.earlier}")
    lora = stacking.trunk_adapters(config) if stacking.trunk_transformed(st) else st.trunk_lora
    if lora is not None:
        if st.trunk_lora is not None and str(st.trunk_lora.trunk_dtype) != "fp32":
            finding((*lora_key, "trunk_dtype"), f"{'.'.join(lora_key)}.trunk_dtype is a LoRA base's storage; a "
                    "stacking trunk's storage is each stage's precision", "fp32 (stages[].precision "
                    "sets the storage)", str(st.trunk_lora.trunk_dtype))
        smallest = min((min(spec.linear_dims(arch, m)), m) for m in lora.modules)
        if lora.rank > smallest[0]:
            finding((*lora_key, "rank"), f"rank {lora.rank} is larger than the layer: "
                    f"{smallest[1]} has {smallest[0]} features on its narrow side", f"at most {smallest[0]}",
                    str(lora.rank))
    prog = st.progressive_lora
    if prog is not None and lora is None:
        finding(("model", "stacking", "progressive_lora"), "progressive_lora adds an adapter beside each trunk "
                "block's own at every later grow; this trunk has no adapters", "trunk_lora, model.lora or "
                "trunk_strategy qlora (with earlier: freeze)", "no trunk adapters")
    elif prog is not None:
        smallest = min((min(spec.linear_dims(arch, m)), m) for m in lora.modules)
        if prog.rank > smallest[0]:
            finding(("model", "stacking", "progressive_lora", "rank"), f"rank {prog.rank} is larger than the layer: "
                    f"{smallest[1]} has {smallest[0]} features on its narrow side", f"at most {smallest[0]}",
                    str(prog.rank))
    _stage_adapter_findings(config, lora, finding)
    if qlora or any(str(s_.precision) == "nf4" for s_ in st.stages[:-1]):
        if find_spec("torchao") is None:
            finding(("model", "stacking", "trunk_strategy" if qlora else "stages"), "an NF4 trunk is quantized by "
                    "torchao, which is not installed", "pip install 'apr[quant]' (torchao)", "no torchao")
        odd = [m for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
               if math.prod(spec.linear_dims(arch, m)) % spec.NF4_BLOCK]
        if odd:
            finding(("model", "stacking", "trunk_strategy" if qlora else "stages"), f"NF4 quantizes blocks of "
                    f"{spec.NF4_BLOCK} weights; {', '.join(odd)} of this architecture do not split into them",
                    f"projections with a multiple of {spec.NF4_BLOCK} weights", ", ".join(odd))
    if st.freeze_embedding and (str(st.earlier) != "freeze" or arch.tie_word_embeddings):
        finding(("model", "stacking", "freeze_embedding"), "freeze_embedding makes the embedding part of the frozen "
                "trunk: it needs earlier: freeze and an LM head of its own (tied embeddings train through the head)",
                "earlier: freeze, tie_word_embeddings: false",
                f"earlier: {st.earlier}, tie_word_embeddings: {str(arch.tie_word_embeddings).lower()}")
    if st.cache_activations:
        needs = [(not st.freeze_embedding, "freeze_embedding: true (a training embedding changes the trunk's output)"),
                 (str(st.earlier) != "freeze", "earlier: freeze (a training trunk changes its output)"),
                 (str(st.building_mode) == "prepend", "building_mode: append (a prepended stack sits below the "
                  "trunk, so the trunk's input changes every step)"),
                 (st.trunk_lora is not None or qlora, "a trunk without adapters (they train, so its output changes)")]
        for missing, want in needs:
            if missing:
                finding(("model", "stacking", "cache_activations"), f"cache_activations stores the trunk's output "
                        f"once per row; that needs {want}", want.split(" (")[0], "cache_activations: true")
    if stacking.trunk_transformed(st) and str(config.training.sharding) != "none":
        finding(("training", "sharding"), "a stacking trunk stored in another precision or with adapters runs on "
                "autograd without FSDP2: sharding NF4 and half-precision trunk weights beside float32 adapters is "
                "not built", "training.sharding: none (DDP runs it)", str(config.training.sharding))
    return []


def qlora_findings(loaded: LoadedConfig) -> list[Finding]:
    """``model.lora.trunk_dtype: nf4`` (QLoRA) that cannot run: torchao missing, projections that do
    not split into NF4's 64-weight blocks, or FSDP2 sharding (an NF4 base is not one float32 group)."""
    lora = loaded.config.model.lora
    if lora is None or str(lora.trunk_dtype) != "nf4":
        return []
    arch, out = loaded.config.model.architecture, []

    def finding(key: tuple, message: str, expected: str, got: str) -> None:
        file, line, column = loaded.source.where(key)
        out.append(Finding("error", "config.lora", message, path=".".join(key), file=file, line=line, column=column,
                           expected=expected, got=got))

    key = ("model", "lora", "trunk_dtype")
    if find_spec("torchao") is None:
        finding(key, "model.lora.trunk_dtype nf4 quantizes the base with torchao, which is not installed",
                "pip install 'apr[quant]' (torchao)", "no torchao")
    odd = [m for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
           if math.prod(spec.linear_dims(arch, m)) % spec.NF4_BLOCK]
    if odd:
        finding(key, f"NF4 quantizes blocks of {spec.NF4_BLOCK} weights; {', '.join(odd)} of this architecture do "
                "not split into them", f"projections with a multiple of {spec.NF4_BLOCK} weights, or trunk_dtype "
                "fp32 / bf16", ", ".join(odd))
    if str(loaded.config.training.sharding) != "none":
        finding(("training", "sharding"), "model.lora.trunk_dtype nf4 runs replicated (one process or DDP): FSDP2 "
                "shards float32 or bf16 tensors by rows, not NF4 codes and their scalers",
                "sharding: none, or trunk_dtype fp32 / bf16", str(loaded.config.training.sharding))
    return out


def sharding_findings(loaded: LoadedConfig, world_size: int | None = None, nodes: int | None = None) -> list[Finding]:
    """`training.sharding` with a layout that cannot exist (docs/design.md, "The composed engine"):
    hybrid over nodes that do not split the ranks evenly; every feature runs on shards.
    ``world_size``/``nodes``: the plan's (``--world-size``/``--nodes``; default the config's)."""

    c = loaded.config
    tr = c.training
    world_size = tr.world_size if world_size is None else world_size
    nodes = tr.nodes if nodes is None else nodes
    if str(tr.sharding) == "none":
        return []
    out = []
    file, line, column = loaded.source.where(("training", "sharding"))

    if str(tr.sharding) == "hybrid" and world_size > 1 and world_size % nodes:
        where = loaded.source.where(("training", "nodes"))
        out.append(Finding("error", "config.sharding", f"training.sharding hybrid with {world_size} ranks "
                           f"(training.world_size / --world-size) on {nodes} nodes (training.nodes / --nodes): "
                           "every node needs the same number of ranks",
                           path="training.nodes", file=file, line=where[1] or line, column=where[2] or column,
                           expected=f"nodes dividing {world_size}", got=str(nodes)))
    if world_size == 1:
        out.append(Finding("info", "config.sharding", "training.sharding takes effect under torchrun with more than "
                           "one process; a single process holds everything", path="training.sharding", file=file,
                           line=line, column=column))
    return out


# validate's Python checks, the config keys each reads (a check is skipped when one of them failed
# the schema: it would judge a placeholder), and what the plan runs instead: the name of its own,
# fuller version (apr/plan/build.py: the data's step count, the world size), or None: the plan runs
# validate's check as it is (``plan_checks``), so apply never runs a config validate refuses.
# tests/plan/test_validate.py checks that every name is called in apr/plan/build.py.
_CHECKS: tuple = (
    (alert_config_findings, (("monitoring", "alerts"), ("monitoring", "block_norms")), "alert_config_findings"),
    (output_dir_findings, (("training", "output_dir"), ("data",)), "output_dir_findings"),
    (data_path_findings, (("data",),), "data_path_findings"),
    (compile_findings, (("training", "execution"), ("training", "device")), "compile_findings"),
    (sink_findings, (("monitoring", "sinks"),), "sink_findings"),
    (_sink_target_findings, (("monitoring", "sinks"), ("data",), ("training", "output_dir")),
     "sink_target_findings"),
    (_mixture_findings, (("data",), ("training",)), "mixture_config_findings"),
    (warmup_findings, (("training", "max_steps"), ("training", "warmup_steps")),
     "evaluate_contracts"),  # C-TRAINCFG-004 over the data's step count
    (lambda loaded: early_stopping_findings(loaded, loaded.config.training.max_steps),
     (("training",), ("data", "val")), "early_stopping_findings"),
    (lambda loaded: survival_findings(loaded, loaded.config.training.max_steps), (("training",),),
     "survival_findings"),
    (lambda loaded: stacking_findings(loaded, loaded.config.training.max_steps),
     (("model",), ("training", "max_steps")), "stacking_findings"),
    (_distill_findings, (("training",), ("model",)), "distill_config_findings"),
    (_mlm_findings, (("training",), ("model",), ("evaluation",)), None),
    (_moe_findings, (("training",), ("model",)), None),
    (_time_findings, (("training",), ("model",)), None),
    (_custom_findings, (("training",), ("model",), ("data",)), "custom_findings"),
    (_mla_findings, (("training",), ("model",)), "mla_config_findings"),
    (sharding_findings, (("training",), ("model",), ("evaluation",)), "sharding_findings"),
    (qlora_findings, (("model",), ("training", "sharding")), None),
    (lambda loaded: orchestrator_findings(loaded, loaded.config.training.max_steps),
     (("training",), ("optimizer",), ("model", "stacking"), ("data",)), "orchestrator_findings"),
    (reduction_findings, (("training",), ("model",)), "reduction_findings"),
    (_state_dtype_findings, (("training",), ("model",), ("optimizer",)), "state_dtype_findings"),
)


def plan_checks(loaded: LoadedConfig) -> list[Finding]:
    """validate's checks that the plan has no fuller version of, run as they are (``_CHECKS``)."""
    return [f for check, _reads, own in _CHECKS if own is None for f in check(loaded)]
