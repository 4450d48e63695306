"""The feature x layout matrix as data (docs/design.md, "The composed engine": its composition table).

Each feature names, for each layout, the pytest node id that runs it, or why it is refused or not
tested. The table in docs/design.md is generated from this list (``table_markdown``);
``tests/steps/test_composition.py`` checks that the table is current, that every layout has a cell,
and that every node id is collected by pytest with its layout visible in its parameters (``none`` or
``ddp`` for DDP, ``full``, ``hybrid``). A feature refused on a layout is refused for a physical
reason by ``apr train validate`` (apr/plan/validate.py), which the cell names. Torch-free data.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("one", "ddp", "full", "hybrid")
LAYOUT_TITLES = {"one": "1 proc", "ddp": "DDP", "full": "FSDP2 full", "hybrid": "FSDP2 hybrid"}
# the words a node id's parameters must hold to run that layout ("none": training.sharding none on ranks)
LAYOUT_PARAMS = {"ddp": ("ddp", "none"), "full": ("full",), "hybrid": ("hybrid",)}


@dataclass(frozen=True)
class Cell:
    tests: tuple[str, ...] = ()  # pytest node ids that run this feature on this layout
    refused: str | None = None  # the physical reason validate refuses it
    not_tested: str | None = None  # why no test runs it (and what is believed)
    note: str = ""  # the bound or what the test compares

    def render(self) -> str:
        if self.refused is not None:
            return f"refused: {self.refused}"
        if self.not_tested is not None:
            return f"not tested: {self.not_tested}"
        return ", ".join(f"`{t}`" for t in self.tests) + (f" ({self.note})" if self.note else "")


def tested(*tests: str, note: str = "") -> Cell:
    return Cell(tests=tests, note=note)


def refused(reason: str) -> Cell:
    return Cell(refused=reason)


def not_tested(reason: str) -> Cell:
    return Cell(not_tested=reason)


@dataclass(frozen=True)
class Feature:
    name: str
    cells: dict  # layout -> Cell


_C = "tests/scenarios/test_composition.py::"
_S = "tests/distributed/test_sharding.py::"
_D = "tests/distributed/test_data_parallel.py::"
_GU = _S + "test_group_updaters_on_shards_equal_one_process_with_twice_the_batch"
_ML = "tests/distributed/test_custom_ranks.py::" \
    "test_the_masked_lm_on_two_ranks_equals_one_process_accumulating_the_same_micro_batches"
_CW = "tests/distributed/test_canonical_world_sizes.py::" \
    "test_four_ranks_one_process_and_resumes_across_world_sizes_end_bitwise_equal"
_CT = "tests/distributed/test_canonical.py::test_two_ranks_one_process_and_a_resume_on_fewer_ranks_end_bitwise_equal"

FEATURES: list[Feature] = [
    Feature("plain pretraining, both sources, every clip mode", {
        "one": tested("tests/train/test_engine.py::test_interleaved_equals_standard_over_20_steps"),
        "ddp": tested(f"{_D}test_two_ranks_equal_one_process_with_twice_the_batch"),
        "full": tested(f"{_S}test_two_sharded_ranks_equal_one_process_with_twice_the_batch"
                       "[standard-full-2-1-global-None]",
                       f"{_S}test_two_sharded_ranks_equal_one_process_with_twice_the_batch"
                       "[interleaved-full-2-1-global-execution2]"),
        "hybrid": tested(f"{_S}test_hybrid_sharding_replicates_across_nodes_and_equals_one_process"),
    }),
    Feature("activations keep / selective / recompute, the flat-buffer walk", {
        "one": tested("tests/train/test_engine_execution.py::test_every_policy_gives_the_lean_walks_weights_bitwise",
                      note="bitwise"),
        "ddp": not_tested("each rank walks its own micro-batch under the same per-block modes"),
        "full": tested(f"{_S}test_two_sharded_ranks_equal_one_process_with_twice_the_batch"
                       "[interleaved-full-2-1-global-execution2]",
                       f"{_S}test_two_sharded_ranks_equal_one_process_with_twice_the_batch"
                       "[interleaved-full-2-1-per_block-execution4]", note="recompute; selective"),
        "hybrid": not_tested("the sharded walk of `full` within each node"),
    }),
    Feature("activations selective / recompute, autograd", {
        "one": tested("tests/train/test_engine_execution.py::"
                      "test_autograd_honours_the_activation_policy_with_the_same_weights", note="bitwise"),
        "ddp": not_tested("the same Engine.hidden_states on each rank"),
        "full": not_tested("torch.utils.checkpoint inside FSDP2's root forward"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("AdamW updater", {
        "one": tested("tests/train/test_updaters.py::test_the_flat_update_and_torch_adamw_agree"),
        "ddp": tested(f"{_D}test_two_ranks_equal_one_process_with_twice_the_batch"),
        "full": tested(f"{_S}test_two_sharded_ranks_equal_one_process_with_twice_the_batch"
                       "[standard-full-2-1-global-None]"),
        "hybrid": tested(f"{_S}test_hybrid_sharding_replicates_across_nodes_and_equals_one_process"),
    }),
    Feature("SGD / SWATS updaters", {
        "one": tested("tests/train/test_updaters.py::test_swats_resumes_exactly_across_its_switch",
                      "tests/train/test_updaters.py::test_sgd_and_swats_on_autograd_train_as_on_the_walk_and_resume",
                      note="update_group on the walk's flat group and autograd's gathered group"),
        "ddp": tested(f"{_GU}[sgd-interleaved-none]", f"{_GU}[swats-standard-none]"),
        "full": tested(f"{_GU}[sgd-standard-full]", f"{_GU}[swats-interleaved-full]",
                       note="local shards; SWATS' dot products summed over the shard group"),
        "hybrid": not_tested("as `full`, the dot products over the node's shard group"),
    }),
    Feature("Lion updater", {
        "one": tested("tests/train/test_updaters.py::test_lion_follows_the_papers_rule",
                      "tests/train/test_updaters.py::test_lion_on_autograd_trains_as_on_the_walk",
                      "tests/train/test_updaters.py::test_a_run_resumed_from_a_middle_checkpoint_ends_bitwise_equal"
                      "[lion-interleaved]", note="the walk, and autograd through GroupedUpdates; resume bitwise"),
        "ddp": not_tested("the walk's update is per rank, as SGD's (tested)"),
        "full": tested(f"{_GU}[lion-interleaved-full]", note="a zero second moment held, as the walk holds"),
        "hybrid": tested(f"{_GU}[lion-standard-hybrid]"),
    }),
    Feature("Adafactor updater (autograd only)", {
        "one": tested("tests/train/test_updaters.py::test_adafactors_first_step_is_the_factored_rule",
                      "tests/train/test_updaters.py::test_a_run_resumed_from_a_middle_checkpoint_ends_bitwise_equal"
                      "[adafactor-standard]", note="torch.optim.Adafactor; the walk refused (no matrix shapes)"),
        "ddp": not_tested("torch's Adafactor on each rank's whole, averaged gradients, as AdamW's"),
        "full": refused("row and column statistics are means over whole rows and columns; a rank holds some rows"),
        "hybrid": refused("as `full`"),
    }),
    Feature("LoRA (both sources) + in-training tasks and samples", {
        "one": tested("tests/train/test_lora.py::test_interleaved_lora_equals_the_standard_engine",
                      "tests/evaluate/test_during_training.py::test_a_stop_alert_on_a_task_score_stops_the_run"),
        "ddp": tested(f"{_C}test_lora_with_in_training_samples_and_tasks_on_shards_equals_one_process"
                      "[interleaved-none]", note="rank 0 evaluates"),
        "full": tested(f"{_C}test_lora_with_in_training_samples_and_tasks_on_shards_equals_one_process"
                       "[interleaved-full]",
                       f"{_C}test_lora_with_in_training_samples_and_tasks_on_shards_equals_one_process[standard-full]",
                       note="1e-5, same scores and samples"),
        "hybrid": tested(f"{_C}test_lora_with_in_training_samples_and_tasks_on_shards_equals_one_process"
                         "[interleaved-hybrid]"),
    }),
    Feature("blockwise distillation", {
        "one": tested("tests/train/test_distill.py::test_a_distillation_run_goes_through_both_phases_and_records_them"),
        "ddp": tested(f"{_C}test_blockwise_distillation_on_shards_equals_one_process[none]"),
        "full": tested(f"{_C}test_blockwise_distillation_on_shards_equals_one_process[full]", note="1e-5"),
        "hybrid": tested(f"{_C}test_blockwise_distillation_on_shards_equals_one_process[hybrid]"),
    }),
    Feature("progressive stacking (grow + freeze)", {
        "one": tested("tests/train/test_stacking.py::test_kill_9_in_stage_2_resumes_bitwise"),
        "ddp": not_tested("no test runs stacking on DDP ranks (the sharded cells grow through the same "
                          "rebuild_engine)"),
        "full": tested(f"{_C}test_progressive_stacking_grows_and_freezes_on_shards_as_in_one_process[full]",
                       note="1e-6; frozen blocks unchanged"),
        "hybrid": tested(f"{_C}test_progressive_stacking_grows_and_freezes_on_shards_as_in_one_process[hybrid]"),
    }),
    Feature("AdaGC", {
        "one": tested("tests/train/test_engine_execution.py::"
                      "test_adagc_clips_each_tensor_and_the_interleaved_engine_matches_the_standard_one"),
        "ddp": not_tested("test_data_parallel's cases clip globally or per block, not with AdaGC"),
        "full": tested(f"{_C}test_a_mixture_with_adagc_on_shards_equals_one_process[full]"),
        "hybrid": tested(f"{_S}test_hybrid_sharding_replicates_across_nodes_and_equals_one_process"
                         "[hybrid-interleaved-1-adagc]"),
    }),
    Feature("rollback", {
        "one": tested("tests/train/test_survive.py::test_rollback_skips_the_window_and_ends_as_a_run_without_it"),
        "ddp": not_tested("the rollback test runs `full` and `hybrid` only"),
        "full": tested(f"{_S}test_a_sharded_run_rolls_back_a_spike_and_ends_as_a_run_without_it[full]",
                       note="bitwise"),
        "hybrid": tested(f"{_S}test_a_sharded_run_rolls_back_a_spike_and_ends_as_a_run_without_it[hybrid]",
                         note="bitwise"),
    }),
    Feature("a signal on one rank (every rank stops after the same step)", {
        "one": tested("tests/train/test_stop.py::test_one_process_reads_the_signal_once_and_keeps_its_own_stop"),
        "ddp": tested(f"{_D}test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_its_checkpoint"
                      "[ddp-rank1-compute-3]",
                      f"{_D}test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_its_checkpoint"
                      "[ddp-rank0-log-5]"),
        "full": not_tested("the same loop and agreement; the sharded save is a collective every rank joins"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("mixtures", {
        "one": tested("tests/train/test_mixture_run.py::test_kill_9_and_resume_draws_the_same_rows"),
        "ddp": not_tested("test_mixture_run's 2-rank test resumes on 1 rank; no parameter names the layout"),
        "full": tested(f"{_C}test_a_mixture_with_adagc_on_shards_equals_one_process[full]",
                       note="3.2e-7, the same rows per source"),
        "hybrid": tested(f"{_C}test_a_mixture_with_adagc_on_shards_equals_one_process[hybrid]"),
    }),
    Feature("elastic resume (another number of ranks)", {
        "one": not_tested("one process has no other layout; the 2 -> 1 resumes are the `full` cell"),
        "ddp": not_tested("the elastic tests run `training.sharding: full`"),
        "full": tested(f"{_S}test_a_sharded_run_killed_mid_save_resumes_on_one_rank_as_the_uninterrupted_one[full]",
                       f"{_S}test_a_run_resumed_on_more_ranks_ends_as_the_uninterrupted_one[full]"),
        "hybrid": not_tested("2 full -> 4 as a 2 x 2 hybrid mesh is part of the `full` cell's second test"),
    }),
    Feature("compiled blocks", {
        "one": tested("tests/train/test_compile.py::test_compiled_blocks_train_the_same_weights_as_eager_ones"),
        "ddp": tested(f"{_C}test_compiled_blocks_on_shards_equal_one_process[none]"),
        "full": tested(f"{_C}test_compiled_blocks_on_shards_equal_one_process[full]", note="1e-5"),
        "hybrid": tested(f"{_C}test_compiled_blocks_on_shards_equal_one_process[hybrid]"),
    }),
    Feature("orchestration (exact branches, decisions, safety)", {
        "one": tested("tests/train/test_orchestrator.py::"
                      "test_the_winner_continues_bitwise_as_if_chosen_without_branching"),
        "ddp": tested("tests/distributed/test_orchestrator_ddp.py::"
                      "test_two_ranks_decide_alike_and_equal_one_process_with_twice_the_batch[none]"),
        "full": tested("tests/distributed/test_orchestrator_ddp.py::"
                       "test_two_ranks_decide_alike_and_equal_one_process_with_twice_the_batch[full]",
                       note="with nowcasting; 1e-5"),
        "hybrid": not_tested("the same per-rank snapshots as `full`"),
    }),
    Feature("LoRA with `trunk_dtype: bf16`", {
        "one": tested("tests/train/test_lora.py::test_interleaved_lora_equals_the_standard_engine"),
        "ddp": not_tested("the bf16 trunk's sharded test compares against DDP; no DDP-only test"),
        "full": not_tested("tests/scenarios/test_composition.py::test_a_bf16_lora_trunk_on_shards_trains_as_"
                           "data_parallel runs it, but no parameter names the layout"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("stacking trunk (precision, trunk_lora, qlora, cache_activations)", {
        "one": tested("tests/model/test_trunk.py::test_adapters_start_at_the_stored_weights_function",
                      "tests/train/test_trunk_cache.py::test_the_cache_folder_is_keyed_by_the_trunk_weights"),
        "ddp": not_tested("tests/distributed/test_data_parallel.py::test_two_ranks_equal_one_process_on_a_"
                          "stacked_run_with_a_qlora_trunk_grown_between_stages runs it (1e-4); no parameter "
                          "names the layout"),
        "full": refused("a stored trunk is not FSDP2's one float32 parameter group (validate: training.sharding)"),
        "hybrid": refused("as `full`"),
    }),
    Feature("narrower distillation student (learned projections)", {
        "one": tested("tests/train/test_distill.py::test_a_distillation_run_goes_through_both_phases_and_records_them"),
        "ddp": not_tested("the projections' gradients are all-reduced with the rest"),
        "full": refused("FSDP2 shards the model's groups only, not the projections (validate)"),
        "hybrid": refused("as `full`"),
    }),
    Feature("teacher output cache", {
        "one": tested("tests/train/test_teacher_cache.py::"
                      "test_a_cached_phase_1_trains_the_student_bitwise_as_an_uncached_one_cold_and_warm"),
        "ddp": not_tested("each rank writes its own entry"),
        "full": not_tested("as DDP"),
        "hybrid": not_tested("as DDP"),
    }),
    Feature("apr train fork (a new run from a checkpoint, with overrides)", {
        "one": tested("tests/test_fork.py::"
                      "test_a_fork_with_no_overrides_continues_bitwise_as_the_parent_and_records_it", note="bitwise"),
        "ddp": not_tested("a planned apply resuming the parent's checkpoint: the resume cells' path"),
        "full": not_tested("as DDP; a sharded parent's parts are read as any sharded resume"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("apr train steer (changes at a step boundary, replayed on resume)", {
        "one": tested("tests/train/test_steering.py::"
                      "test_steered_killed_and_resumed_ends_bitwise_as_the_uninterrupted_steered_run", note="bitwise"),
        "ddp": tested("tests/train/test_steering.py::"
                      "test_two_gloo_ranks_apply_a_steer_at_the_same_step_and_a_resume_replays_it[none]",
                      note="every rank's lr from the same step; resumed bitwise"),
        "full": not_tested("as DDP"),
        "hybrid": not_tested("as DDP"),
    }),
    Feature("data drift and histograms during training", {
        "one": tested("tests/train/test_datadrift.py::test_a_run_records_data_drift_in_both_stores_and_alerts_on_it",
                      "tests/train/test_histograms.py::test_a_run_records_every_layers_weight_and_gradient_histograms"),
        "ddp": not_tested("rank 0 samples and records"),
        "full": not_tested("drift as DDP; histograms off with a warning (a rank holds shards)"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("canonical reduction (training.reduction), both sources", {
        "one": tested("tests/train/test_reduction.py::"
                      "test_one_process_sums_its_micro_batches_in_the_tree_to_fasts_gradient_within_rounding",
                      "tests/train/test_reduction.py::"
                      "test_the_walk_under_canonical_gives_autograds_canonical_weights_bitwise",
                      note="the tree's gradient within 1e-5 of fast's; the walk's canonical steps are "
                           "autograd's, bitwise"),
        "ddp": tested(_CT + "[ddp-standard-global]", _CT + "[ddp-interleaved-per_block]",
                      note="2 ranks x 2, 1 process x 4 and 2 -> 1 resumed: bitwise, and the same validation losses"),
        "full": tested(_CT + "[full-standard-global]", _CT + "[full-standard-adagc]", _CT + "[full-interleaved-adagc]",
                       note="no reduce-scatter: an all-to-all of each micro-batch's shard rows, the same tree; "
                            "2 x 2, 1 x 4 and 2 -> 1: bitwise, the same validation losses"),
        "hybrid": tested(f"{_CW}[standard-hybrid]", f"{_CW}[interleaved-hybrid]",
                         note="4 ranks in 2 shard groups of 2: 4 x 1 = 1 x 4, 4 -> 2, 4 -> 1 and 1 -> 4 resumed, "
                              "bitwise"),
    }),
    Feature("canonical reduction across world sizes (4 ranks, 4 -> 2 -> 1, 1 -> 4), both sources", {
        "one": tested(f"{_CW}[standard-none]", f"{_CW}[interleaved-none]", note="one process x 4 is the reference"),
        "ddp": tested(f"{_CW}[standard-none]", f"{_CW}[interleaved-none]",
                      note="4 x 1 = 1 x 4; 4 -> 2, 4 -> 1 and 1 -> 4 resumed: bitwise"),
        "full": tested(f"{_CW}[standard-full]", f"{_CW}[interleaved-full]"),
        "hybrid": tested(f"{_CW}[standard-hybrid]", f"{_CW}[interleaved-hybrid]"),
    }),
    Feature("canonical reduction with the orchestrator (rewards, branch losses)", {
        "one": tested("tests/distributed/test_canonical.py::"
                      "test_orchestrated_two_ranks_and_one_process_pick_the_same_branches_and_end_bitwise_equal",
                      note="its one-process run x 4 is the reference of both cells"),
        "ddp": tested("tests/distributed/test_canonical.py::"
                      "test_orchestrated_two_ranks_and_one_process_pick_the_same_branches_and_end_bitwise_equal[ddp]",
                      note="2 x 2 = 1 x 4 = 2 -> 1 resumed between decisions: the same decisions (val losses, "
                           "rewards, branch losses) and weights, bitwise"),
        "full": tested("tests/distributed/test_canonical.py::"
                       "test_orchestrated_two_ranks_and_one_process_pick_the_same_branches_and_end_bitwise_equal"
                       "[full]",
                       "tests/distributed/test_canonical.py::"
                       "test_orchestrated_two_ranks_and_one_process_pick_the_same_branches_and_end_bitwise_equal"
                       "[full-interleaved]",
                       note="with a kept nowcast of each rank's rows, read back whole on the resume; bitwise; on "
                            "both sources"),
        "hybrid": not_tested("4 ranks, beyond CI: benchmarks/check_canonical_ranks.py --feature orchestrator "
                             "--sharding hybrid (docs/performance.md); the branches' snapshots are `full`'s"),
    }),
    Feature("canonical reduction with distillation (block ends, autotune)", {
        "one": tested("tests/distributed/test_canonical.py::"
                      "test_distillation_on_two_ranks_and_one_process_decides_alike_and_ends_bitwise_equal",
                      note="its one-process run x 4 is the reference of both cells"),
        "ddp": tested("tests/distributed/test_canonical.py::"
                      "test_distillation_on_two_ranks_and_one_process_decides_alike_and_ends_bitwise_equal[ddp]",
                      note="2 x 2 = 1 x 4 = 2 -> 1 resumed, both phases: bitwise; cache_teacher_outputs refused "
                           "(validate: training.reduction; the world size picks the cache's hits)"),
        "full": tested("tests/distributed/test_canonical.py::"
                       "test_distillation_on_two_ranks_and_one_process_decides_alike_and_ends_bitwise_equal"
                       "[full]", note="as DDP; bitwise"),
        "hybrid": not_tested("4 ranks, beyond CI: benchmarks/check_canonical_ranks.py --feature distill "
                             "--sharding hybrid (docs/performance.md)"),
    }),
    Feature("model dropout (model.architecture.dropout), both sources", {
        "one": tested("tests/train/test_walk.py::test_the_walk_with_dropout_trains_as_autograd[recompute]",
                      "tests/train/test_walk.py::"
                      "test_a_run_with_dropout_resumed_from_a_middle_checkpoint_ends_bitwise_equal[interleaved]",
                      note="the walk replays a recomputed block's masks: 1e-6 of autograd; resume bitwise"),
        "ddp": not_tested("each rank draws its own masks from its own RNG, checkpointed per rank"),
        "full": not_tested("recomputed blocks run under torch.utils.checkpoint inside FSDP2's units, which "
                           "restores the RNG state as the walk does"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("masked-LM objective (training.mode: mlm, autograd)", {
        "one": tested("tests/train/test_losses.py::"
                      "test_an_mlm_run_scores_its_masked_validation_loss_and_resumes_bitwise",
                      note="bitwise resume"),
        "ddp": tested(f"{_ML}[none]", note="a row's mask depends on the seed, the step and its tokens only; "
                                         "canonical: the same validation losses, bitwise"),
        "full": tested(f"{_ML}[full]", note="the masked validation sum inside FSDP2's root forward (Engine.in_root)"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("multi-head latent attention (model.architecture.attention: mla), both sources", {
        "one": tested("tests/train/test_walk.py::test_the_walk_with_dropout_trains_as_autograd[selective-mla]",
                      "tests/train/test_walk.py::"
                      "test_a_run_with_dropout_resumed_from_a_middle_checkpoint_ends_bitwise_equal[interleaved-mla]",
                      note="the walk 1e-6 of autograd; resume bitwise"),
        "ddp": tested("tests/distributed/test_mla_ranks.py::"
                      "test_latent_attention_on_two_ranks_equals_one_process_accumulating_the_same_micro_batches"
                      "[none]", note="the walk; 1 process accumulating the same micro-batches, 1e-6"),
        "full": tested("tests/distributed/test_mla_ranks.py::"
                       "test_latent_attention_on_two_ranks_equals_one_process_accumulating_the_same_micro_batches"
                       "[full]", note="the sharded walk; 1e-6"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("mixture of experts (model.architecture.moe, autograd)", {
        "one": tested("tests/train/test_losses.py::"
                      "test_an_moe_run_records_its_routing_resumes_bitwise_and_its_checkpoint_decodes_with_the_cache",
                      note="bitwise resume; the flat-buffer walk refused (validate: training.engine)"),
        "ddp": tested("tests/distributed/test_moe_ranks.py::"
                      "test_experts_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches[none]",
                      note="1 process accumulating the same micro-batches, 1e-6"),
        "full": tested("tests/distributed/test_moe_ranks.py::"
                       "test_experts_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches[full]",
                       note="each block's experts in its FSDP2 unit; 1e-6"),
        "hybrid": not_tested("`full` within each node, replicated across nodes as for a dense block"),
    }),
    Feature("time conditioning (model.architecture.time: input, depth, time-step masking), autograd", {
        "one": tested("tests/train/test_losses.py::"
                      "test_a_time_conditioned_run_resumes_bitwise_and_its_checkpoint_decodes_at_eval_time",
                      "tests/train/test_losses.py::"
                      "test_time_as_depth_runs_each_stage_at_its_step_and_resumes_across_the_grow_bitwise",
                      note="bitwise resume, across a grow for depth; the flat-buffer walk refused (validate: "
                           "training.engine)"),
        "ddp": tested("tests/distributed/test_time_ranks.py::"
                      "test_time_steps_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches[none]",
                      note="a row's step depends on the seed, the step and its tokens only; 1e-6"),
        "full": tested("tests/distributed/test_time_ranks.py::"
                       "test_time_steps_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches[full]",
                       note="the time embedding in the root unit with the token embedding; 1e-6"),
        "hybrid": not_tested("`full` within each node, replicated across nodes as the token embedding"),
    }),
    Feature("custom targets (training.mode: custom, autograd)", {
        "one": tested("tests/train/test_losses.py::"
                      "test_a_custom_run_whose_targets_are_its_ids_is_the_causal_lm_bitwise_and_resumes_bitwise",
                      "tests/train/test_mixture_run.py::"
                      "test_custom_targets_through_a_mixture_equal_the_causal_lm_when_they_are_the_ids",
                      note="targets = ids: the causal LM's weights bit for bit (a mixture too); bitwise resume"),
        "ddp": tested("tests/distributed/test_custom_ranks.py::"
                      "test_custom_targets_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches[none]",
                      note="each rank's rows carry their targets; 1 process accumulating the same micro-batches, "
                           "1e-6"),
        "full": tested("tests/distributed/test_custom_ranks.py::"
                       "test_custom_targets_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches[full]",
                       note="its validation sum inside FSDP2's root forward (Engine.in_root); 1e-6"),
        "hybrid": not_tested("as `full`"),
    }),
    Feature("LoRA with `trunk_dtype: nf4` (QLoRA over an imported base)", {
        "one": tested("tests/checkpoint/test_hf_families.py::"
                      "test_qlora_over_each_family_starts_at_transformers_over_the_nf4_base_in_both_engines",
                      note="both sources; resume bitwise, merged and PEFT exports"),
        "ddp": not_tested("the NF4 base is replicated on every rank, as the bf16 trunk"),
        "full": refused("FSDP2 shards float32/bf16 rows, not NF4 codes (validate: training.sharding)"),
        "hybrid": refused("as `full`"),
    }),
    Feature("bf16 state (training.state_dtype: bf16, stochastic rounding), the flat-buffer walk", {
        "one": tested("tests/train/test_updaters.py::test_bf16_state_holds_6_bytes_a_parameter_and_resumes_bitwise",
                      "tests/train/test_updaters.py::test_a_bf16_state_run_checkpoints_bf16_and_resumes_bitwise",
                      note="6 B/param; resume bitwise; autograd refused (validate: training.state_dtype)"),
        "ddp": refused("not built: the ranks would all-reduce bf16 gradients (validate: training.state_dtype)"),
        "full": refused("not built: FSDP2 shards hold float32 state (validate: training.state_dtype)"),
        "hybrid": refused("as `full`"),
    }),
]


def node_ids() -> list[tuple[str, str, str]]:
    """Every (feature, layout, node id) the matrix names."""
    return [(f.name, layout, t) for f in FEATURES for layout, cell in f.cells.items() for t in cell.tests]


def table_markdown() -> str:
    """The composition table of docs/design.md."""
    head = "| feature | " + " | ".join(LAYOUT_TITLES[x] for x in LAYOUTS) + " |"
    rule = "|---" * (len(LAYOUTS) + 1) + "|"
    rows = [f"| {f.name} | " + " | ".join(f.cells[x].render() for x in LAYOUTS) + " |" for f in FEATURES]
    return "\n".join([head, rule, *rows])


if __name__ == "__main__":  # python -m apr.steps.composition: the table, to paste into docs/design.md
    print(table_markdown())
