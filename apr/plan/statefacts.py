"""What `apr train validate` refuses about bf16 state (``training.state_dtype: bf16``; docs/training.md,
"bf16 state"). Torch-free.

bf16 state is the flat-buffer walk's: its weights, AdamW moments and gradients are bf16 buffers and
its fused AdamW (apr/kernels) writes each float32 update back with stochastic rounding. What would
store the state elsewhere, or round it another way, is refused at ``training.state_dtype`` with the
reason.
"""

from __future__ import annotations

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.memory.buffers import sharded
from apr.steps.execution import gradient_source
from apr.steps.stacking import trunk_storage

KEY = ("training", "state_dtype")


def state_dtype_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    tr = c.training
    if str(tr.state_dtype) != "bf16":
        return []
    accumulation = tr.gradient_accumulation if isinstance(tr.gradient_accumulation, int) else 1
    checks = [
        (str(tr.mixed_precision) != "bf16", "the bf16 weights are what the forward computes with: the compute "
         "precision must be bf16 (fp32 would need a float32 copy of every weight, fp16 a second rounding)",
         "training.mixed_precision: bf16", f"mixed_precision: {tr.mixed_precision}"),
        (str(c.optimizer.name) != "adamw", "the stochastically rounded update is AdamW's fused kernel; "
         f"{c.optimizer.name} keeps float32 state", "optimizer.name: adamw", f"optimizer.name: {c.optimizer.name}"),
        (gradient_source(c) != "interleaved", "autograd (training.engine: standard, distillation, the masked LM) "
         "updates through torch.optim.AdamW, which rounds a bf16 parameter's update to nearest (+2.6% final loss "
         "on the demo, docs/performance.md): bf16 state runs on the flat-buffer walk",
         "training.engine: interleaved", f"engine {gradient_source(c)}"),
        (sharded(c), "not built: FSDP2 shards hold float32 state (training.sharding)", "training.sharding: none",
         f"sharding: {tr.sharding}"),
        (tr.world_size > 1 and not sharded(c), "not built: data parallelism would all-reduce bf16 gradients "
         "(summed in bf16 over the ranks)", "training.world_size: 1", f"world_size: {tr.world_size}"),
        (accumulation > 1, "a parameter's gradient has its dtype: micro-batches would be summed in bf16 gradient "
         "buffers", "training.gradient_accumulation: 1", f"gradient_accumulation: {accumulation}"),
        (c.model.lora is not None, "LoRA trains float32 adapters over a frozen base (model.lora.trunk_dtype "
         "stores the base in bf16)", "no model.lora", "model.lora"),
        (bool(trunk_storage(c)), "a stacking trunk is stored by model.stacking, outside the optimizer's state",
         "no transformed stacking trunk", "model.stacking trunk"),
        (tr.orchestrator.enabled, "not built: the orchestrator's SGD strategies update float32 state",
         "training.orchestrator.enabled: false", "enabled"),
    ]
    file, line, column = loaded.source.where(KEY)
    return [Finding("error", "config.state_dtype", f"training.state_dtype bf16: {message}", path=".".join(KEY),
                    file=file, line=line, column=column, expected=expected, got=got)
            for bad, message, expected, got in checks if bad]
