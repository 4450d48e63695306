"""`apr inspect`: what is inside a checkpoint: weight statistics and histograms per layer, the update
between two checkpoints, attention maps for a prompt (docs/inspect.md)."""
