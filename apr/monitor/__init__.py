"""`apr monitor`: the live terminal dashboard, the JSON monitor and the discovery of active runs.

The monitor only reads files (`<run_dir>/training_state.json`, `<run_dir>/config.yaml` and the
global registry `$APR_HOME/experiments.db`); it never talks to the trainer, so any number of
monitors can watch one run from any terminal. Importing this package imports nothing heavy:
Textual is imported by `apr.monitor.app` only.
"""
