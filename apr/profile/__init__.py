"""`apr profile`: one training step measured layer by layer, inference latency, and how far the
plan's FLOPs and memory figures are from the measured ones (docs/profile.md)."""
