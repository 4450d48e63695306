"""apr: plan, apply and record language-model pretraining from one YAML file."""

__version__ = "0.1.0"
