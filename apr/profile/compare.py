"""How far the plan's figures are from a measured step: FLOPs per token (``apr.model.spec``), the
weights, the activations a kept block saves and, on a GPU, the peak (``apr.memory``).

The step profiled from weights runs the model under plain autograd, which is what
``training.engine: standard`` does, so the plan is asked about the same config with that engine,
the measured batch, sequence length, precision and device. The step profiled from a config is the
engine its run would build (apr/profile/engine.py), so the plan is asked about that config under
its resolved execution policy (``compare_engine``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from apr.config.schema import AprConfig, Architecture, Device, Engine, MixedPrecision
from apr.memory.activations import kept_block_bytes
from apr.memory.table import memory_table
from apr.model.spec import DTYPE_BYTES, flops_per_token, param_count
from apr.profile.engine import EngineStepProfile, one_process_rows
from apr.profile.step import StepProfile
from apr.steps.execution import step_cost_f
from apr.steps.resolved import Resolved


@dataclass
class Comparison:
    figure: str
    plan: float | None
    measured: float | None
    unit: str
    basis: str  # where the plan's number comes from

    @property
    def ratio(self) -> float | None:
        """measured / plan: 1.0 is exact; above 1 the plan underestimates."""
        if self.plan in (None, 0) or self.measured is None:
            return None
        return self.measured / self.plan

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["ratio"] = round(self.ratio, 4) if self.ratio is not None else None
        return doc


def plan_config(config: AprConfig | None, arch: Architecture, profile: StepProfile) -> AprConfig:
    """The config the plan is asked about: the checkpoint's (or, for a Hugging Face folder, a
    minimal one around its architecture) with the profiled step's engine, shape, precision and device."""
    if config is None:
        config = AprConfig.model_validate({"model": {"architecture": arch.model_dump()},
                                           "data": {"train": "-", "batch_size": 1, "seq_len": 1}})
    device = Device.cuda if profile.device.startswith("cuda") else Device.cpu
    data = config.data.model_copy(update={"batch_size": profile.batch_size, "seq_len": profile.seq_len})
    training = config.training.model_copy(update={
        "engine": Engine.standard, "mixed_precision": MixedPrecision(profile.precision), "device": device})
    return config.model_copy(update={"data": data, "training": training})


def compare(profile: StepProfile, config: AprConfig) -> list[Comparison]:
    arch = config.model.architecture
    blocks = [r.saved_bytes for r in profile.layers if r.name.startswith("layers.")]
    rows = [
        Comparison("flops_per_token", flops_per_token(arch, profile.seq_len), profile.counted_flops / profile.tokens,
                   "FLOP", "apr.model.spec.flops_per_token: 6N + 12*layers*hidden*seq"),
        Comparison("weight_bytes", param_count(arch) * DTYPE_BYTES["float32"], profile.weight_bytes, "B",
                   "apr.model.spec.param_count * 4 (fp32 master weights)"),
        Comparison("block_saved_bytes", kept_block_bytes(config), statistics.median(blocks) if blocks else None, "B",
                   "apr.memory.activations keep_* widths: one kept block's autograd activations"),
    ]
    if profile.peak_bytes is not None:
        table = memory_table(config)
        planned = sum(r.bytes for r in table if r.component != "cuda_context")  # torch's counters never see it
        rows.append(Comparison("peak_bytes", planned, profile.peak_bytes, "B",
                               "apr.memory.table.memory_table, engine standard, less cuda_context"))
    return rows


def compare_engine(profile: EngineStepProfile, resolved: Resolved) -> list[Comparison]:
    """The plan's figures for the engine profiled from a config: hardware FLOPs per token (the
    model's FLOPs times the execution's cost in forward-equivalents over 3: recompute and a
    norm-only pre-pass walk are work the plan charges), the weights and, on a GPU, the peak of one
    unsharded process under the resolved policy."""
    config, execution = resolved.config, resolved.execution
    arch = config.model.architecture
    cost = step_cost_f(config, execution)
    rows = [
        Comparison("flops_per_token", flops_per_token(arch, profile.seq_len) * cost / 3.0,
                   profile.counted_flops / profile.tokens, "FLOP",
                   f"apr.model.spec.flops_per_token x {cost:g}F / 3 (the execution's hardware FLOPs)"),
        Comparison("weight_bytes", param_count(arch) * DTYPE_BYTES["float32"], profile.weight_bytes, "B",
                   "apr.model.spec.param_count * 4 (fp32 master weights)"),
    ]
    if profile.peak_bytes is not None:
        planned = sum(r.bytes for r in one_process_rows(resolved) if r.component != "cuda_context")
        rows.append(Comparison("peak_bytes", planned, profile.peak_bytes, "B",
                               "apr.memory.table.memory_table, the resolved policy on one unsharded process, "
                               "less cuda_context"))
    return rows
