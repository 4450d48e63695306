"""Training: the interleaved and standard engines, precision, flat buffers and the run loop.

Everything here may import torch; the torch-free step algebra, strategy and schedules are in
``apr.steps``.
"""
