"""Checkpoints: safetensors + JSON written atomically, pruning, exact resume, Hugging Face export.

Importing this package imports neither torch nor safetensors; the modules that need them import
them inside their functions. See docs/checkpoints.md.
"""
