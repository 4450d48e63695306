"""What `apr train validate` refuses about the masked-LM objective (``training.mode: mlm``,
apr/train/losses.py ``MaskedLM``; docs/training.md, "Masked-LM objective"). Torch-free.

The mode and the ``training.mlm`` section go together; the loss runs on autograd only (the
flat-buffer walk fuses the causal-LM loss into its head step); what reads the model left to right
or its next-token loss (a sliding window, samples and tasks during training) is refused with it.
"""

from __future__ import annotations

from functools import partial

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.plan.keyfacts import key_error
from apr.steps.execution import gradient_source

_finding = partial(key_error, code="config.mlm")


def mlm_config_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    tr, arch = c.training, c.model.architecture
    if str(tr.mode) != "mlm":
        return [_finding(loaded, ("training", "mlm"), f"training.mlm is set but training.mode is {tr.mode}",
                         "mode: mlm", str(tr.mode))] if tr.mlm is not None else []
    if tr.mlm is None:
        return [_finding(loaded, ("training", "mode"), "training.mode mlm needs a training.mlm section (at least "
                         "its mask_token_id)", "training.mlm.mask_token_id", "none")]
    stacking = c.model.stacking
    checks = [
        (gradient_source(c) == "interleaved", ("training", "engine"), "the masked-LM loss runs on autograd: the "
         "flat-buffer walk (training.engine: interleaved) fuses the causal-LM loss, every position's next token, "
         "into its head step", "training.engine: standard", str(tr.engine)),
        (tr.mlm.mask_token_id >= arch.vocab_size, ("training", "mlm", "mask_token_id"), "the mask token must be a "
         "row of the embedding", f"below model.architecture.vocab_size ({arch.vocab_size})",
         str(tr.mlm.mask_token_id)),
        (arch.sliding_window is not None, ("model", "architecture", "sliding_window"), "a sliding window looks "
         "back only; the masked LM attends both ways", "no sliding_window", str(arch.sliding_window)),
        (stacking is not None and stacking.cache_activations, ("model", "stacking", "cache_activations"),
         "the trunk's cached rows are of the unmasked input", "cache_activations: false", "true"),
        (bool(c.evaluation.tasks) or c.evaluation.samples is not None, ("evaluation",), "tasks and samples "
         "during training score and generate left to right; a masked LM attends both ways",
         "no evaluation.tasks or samples", "set"),
    ]
    return [_finding(loaded, key, message, expected, got) for bad, key, message, expected, got in checks if bad]
