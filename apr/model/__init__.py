"""The LLaMA-style model. `apr.model.spec` is torch-free (shapes, counts, buffer plan)."""
