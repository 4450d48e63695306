"""What `apr train validate` refuses about the mixture of experts (``model.architecture.moe``,
apr/model/moe.py; docs/moe.md). Torch-free.

The load-balancing loss is added to the training loss on autograd (apr/train/losses.py
``RoutingBalance``); the flat-buffer walk backpropagates block by block from the head's fused loss
and would drop its gradient, so it is refused there. What reads the dense MLP's projections by name
(LoRA's adapters, a distillation student's initialisation, a stacking trunk's storage, an imported
dense checkpoint) is refused with it until it is built for the experts.
"""

from __future__ import annotations

from functools import partial

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.plan.keyfacts import key_error
from apr.steps.execution import gradient_source

_finding = partial(key_error, code="config.moe")


def moe_config_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    tr, model = c.training, c.model
    if model.architecture.moe is None:
        return []
    not_built = "not built for the mixture of experts: "
    checks = [
        (gradient_source(c) == "interleaved", ("training", "engine"), "model.architecture.moe runs on autograd: "
         "the flat-buffer walk (training.engine: interleaved) backpropagates block by block from the LM head's "
         "fused loss and would drop the load-balancing loss's gradient in each block's router",
         "training.engine: standard", str(tr.engine)),
        (model.lora is not None, ("model", "lora"), not_built + "LoRA adapts the dense MLP's and attention's "
         "projections by name", "no model.lora", "set"),
        (str(tr.mode) == "distill", ("training", "mode"), not_built + "a distillation student starts from its "
         "teacher's dense MLP neurons", "causal_lm or mlm", str(tr.mode)),
        (model.stacking is not None, ("model", "stacking"), not_built + "progressive stacking's trunk stores and "
         "adapts the dense MLP's projections", "no model.stacking", "set"),
        (model.init_from is not None, ("model", "init_from"), not_built + "initial weights are read as a dense "
         "LLaMA-family checkpoint", "no model.init_from (train from scratch)", str(model.init_from)),
        (tr.execution.compile is True, ("training", "execution", "compile"), not_built + "each block's routing "
         "reads the experts' row counts on the host, which torch.compile cannot trace", "compile: false or auto",
         "true"),
    ]
    return [_finding(loaded, key, message, expected, got) for bad, key, message, expected, got in checks if bad]
