"""Training: the interleaved and standard engines, schedules, precision and the run loop.

Only ``apr.train.schedule`` and ``apr.train.strategy`` are torch-free (the planner reads them).
"""
