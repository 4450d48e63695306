"""Hyperparameter sweeps (`apr sweep`): a W&B-format sweep file over a base config, Optuna's
samplers, pruners and RDB storage underneath, and every trial planned before it trains.

Modules: ``spec`` (the sweep file), ``space`` (Optuna's search space, sampler and pruner),
``planning`` (each trial's plan; `apr sweep plan`), ``storage`` (the study's RDB storage),
``trial`` (one trial as an `apr train apply` process), ``runner`` (workers), ``results``
(status, best, importances, the plot). docs/sweeps.md is the user's page.
"""
