"""Compose the engine from the resolved plan (docs/design.md, "The composed engine").

``build_engine`` is the one place where a run's parts meet, in the order torchtitan's
``parallelize_llama`` applies its transforms to one model:

1. the model: random init from the seed, or ``model.init_from``'s weights;
2. model transforms: LoRA adapters over a frozen base (``model.lora``), a distillation student
   initialised from its teacher;
3. the one ``Engine`` (``engine.py``) with the loss part (the causal-LM loss or the distillation
   loss, ``distill.py``), its layout (FSDP2 shards when ``training.sharding`` shards the state,
   ``sharded.Shards``; else replicated, ``autograd.Replicated``; the flat-buffer walk keeps its own
   buffers, allocated from the plan's buffer list) and the gradient source the plan chose (the walk,
   ``walk.Walk`` or on shards ``sharded_walk.ShardedWalk``; autograd, ``autograd.Autograd``);
4. recompute and compile: the execution policy's per-block modes, ``compile_blocks``.

The engine receives the resolved plan (apr/steps/resolved.py: execution, gradient source, sharding,
step strategy) and derives none of it; a caller without a plan resolves its config with
``apr.plan.build.resolve_config``.
"""

from __future__ import annotations

import torch

from apr.checkpoint.hf_import import load_into, source_digest
from apr.config.schema import AprConfig
from apr.kernels import KernelBackend, get_backend
from apr.model.llama import LlamaForCausalLM, build_model
from apr.model.lora import add_adapters
from apr.model.trunk import apply_trunk
from apr.steps import stacking
from apr.steps.execution import Execution
from apr.steps.resolved import Resolved
from apr.train.autograd import Autograd, Replicated
from apr.train.compile import compile_blocks
from apr.train.dist import DataParallel
from apr.train.distill import distill_loss
from apr.train.engine import Engine, resolve_device
from apr.train.losses import objective_loss
from apr.train.precision import torch_dtype
from apr.train.walk import Walk


def allocate_buffers(config: AprConfig, device: torch.device,
                     execution: Execution | None = None) -> dict[str, torch.Tensor]:
    """The engine's parameter, optimizer and gradient buffers, allocated from the buffer plan."""
    wanted = {"weights", "compute_weights", "adapters", "adamw_m", "adamw_v", "gradients"}  # frozen: the model's
    return {
        b.name: torch.empty(b.shape, dtype=torch_dtype(b.dtype), device=device)
        for b in Walk.declares(config, execution) if b.component in wanted
    }


def build_model_for(config: AprConfig, seed: int) -> LlamaForCausalLM:
    """The model before any gradient source: init (or ``init_from``) then the LoRA transform."""
    model = build_model(config.model.architecture, seed, device="cpu")
    if config.model.init_from is not None:  # trained weights replace the random init
        load_into(model, config.model.init_from)
    if config.model.lora is not None:  # frozen base, adapters trained
        add_adapters(model, config.model.lora, seed)
    if stacking.trunk_storage(config):  # a stacking trunk in its precision, with its adapters
        apply_trunk(model, config, seed)
    return model


def _compose(plan: Resolved, model: LlamaForCausalLM, device: torch.device, backend: KernelBackend,
             dp: DataParallel | None) -> Engine:
    """The engine with the plan's loss part, layout and gradient source (the flat-buffer walk or
    autograd, either on FSDP2 shards when ``training.sharding`` shards the state over the ranks)."""
    config = plan.config
    distilled = str(config.training.mode) == "distill"
    loss = distill_loss(config, model, device) if distilled else objective_loss(  # None: the causal LM
        config, model, plan.gradient_source)
    engine = Engine(plan, model, device, backend, loss, dp)  # the student on autograd, the teacher whole beside it
    autograd = plan.gradient_source == "standard"
    if engine.sharded:  # FSDP2 needs the process group torchrun started
        from apr.train.sharded import Shards  # lazy: FSDP2 and DTensor are ~1 s of import, sharded runs only
        from apr.train.sharded_walk import ShardedWalk  # lazy: as above

        engine.layout = Shards(engine)
        engine.gradients = Autograd(engine) if autograd else ShardedWalk(engine)
    elif autograd:
        engine.layout = Replicated(engine)
        engine.gradients = Autograd(engine)
    else:  # the walk's state is its flat buffers: no layout object
        if config.model.lora is not None:  # the frozen base on the device as it is; adapters into flat buffers
            model.to(device)
        engine.gradients = Walk(engine, allocate_buffers(config, device, plan.execution))
    return engine


def build_engine(plan: Resolved, device: torch.device | str | None = None, *, seed: int | None = None,
                 backend: KernelBackend | None = None, dp: DataParallel | None = None) -> Engine:
    """A freshly initialised model (or ``model.init_from``'s weights) inside the composed engine the
    resolved plan describes (``apr.plan.build.resolve_config`` for a caller without a plan);
    ``dp``: the data-parallel ranks (torchrun)."""
    if not isinstance(plan, Resolved):
        raise TypeError(f"build_engine takes the resolved plan (apr.steps.resolved.Resolved), got "
                        f"{type(plan).__name__}: resolve a config with apr.steps.resolved.resolve (engine "
                        "only) or apr.plan.build.resolve_config")
    config = plan.config
    tr = config.training
    device = resolve_device(tr.device if device is None else device) if not isinstance(device, torch.device) else device
    backend = backend or get_backend(str(tr.kernels), device)
    model = build_model_for(config, tr.seed if seed is None else seed)
    engine = _compose(plan, model, device, backend, dp)
    if engine.execution.compile:
        compile_blocks(engine.model, device, (config.data.batch_size, config.data.seq_len), engine.cdt,
                       engine.autocast(), sharded=engine.sharded)
    if config.model.lora is not None and config.model.init_from is not None:  # C-LORA-002 wants both
        engine.base_ref = {"init_from": config.model.init_from,
                           "sha256": source_digest(config.model.init_from, config.model.architecture)}
    return engine
