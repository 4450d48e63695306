"""Text generation from a trained model: loading a checkpoint, run directory or Hugging Face folder
with its tokenizer (``load``), the key/value cache decoder (``decode``), the sampling rules
(``sampling``) and the generation loop (``generate``). See docs/generate.md."""
