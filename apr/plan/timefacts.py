"""What `apr train validate` refuses about time conditioning (``model.architecture.time``,
apr/model/time.py; docs/training.md, "Time conditioning"). Torch-free.

The time embedding is added to the token embedding and trained through it on autograd; the
flat-buffer walk embeds tokens without a graph and scatters the embedding's gradient itself, so it
would drop the time embedding's. Time-as-depth maps stacking stages to steps and needs stages;
time-step masking sets the masked LM's masking rate and needs it. What would run the model
without each row's step (the trunk's activation cache) or read weights without a time embedding
(a distillation teacher, ``init_from``) is refused until built.
"""

from __future__ import annotations

from functools import partial

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.plan.keyfacts import key_error
from apr.steps.execution import gradient_source

_TIME = ("model", "architecture", "time")


_finding = partial(key_error, code="config.time")


def time_config_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    tr, model, t = c.training, c.model, c.model.architecture.time
    if t is None:
        return []
    not_built = "not built for time conditioning: "
    stacking = model.stacking
    checks = [
        (gradient_source(c) == "interleaved", ("training", "engine"), "model.architecture.time runs on autograd: the "
         "flat-buffer walk (training.engine: interleaved) embeds tokens without a graph and scatters the "
         "embedding's gradient into its rows itself, which would drop the time embedding's gradient",
         "training.engine: standard", str(tr.engine)),
        (str(t.interpretation) == "depth" and stacking is None, (*_TIME, "interpretation"), "time-as-depth maps "
         "each stacking stage to a time step: there are no stages without model.stacking",
         "model.stacking, or interpretation: input", "depth"),
        (t.masking and str(tr.mode) != "mlm", (*_TIME, "masking"), "time-step masking sets the masked LM's masking "
         "rate from each row's step; a causal LM reads an unmasked prefix", "training.mode: mlm, or masking: false",
         f"training.mode: {tr.mode}"),
        (str(tr.mode) == "distill", ("training", "mode"), not_built + "a distillation teacher's blocks take no time "
         "step", "causal_lm or mlm", str(tr.mode)),
        (model.init_from is not None, ("model", "init_from"), not_built + "initial weights are read as a "
         "LLaMA-family checkpoint, which has no time embedding", "no model.init_from (train from scratch)",
         str(model.init_from)),
        (stacking is not None and stacking.cache_activations, ("model", "stacking", "cache_activations"),
         not_built + "the trunk's cached rows are one forward per row, not one per row and time step",
         "cache_activations: false", "true"),
    ]
    return [_finding(loaded, key, message, expected, got) for bad, key, message, expected, got in checks if bad]
