"""The memory model, torch-free: the buffers each part of the composed engine declares
(``buffers``), the activations the execution policy keeps or recomputes (``activations``), and the
per-GPU table the plan prints and every budget check sums (``table``)."""
