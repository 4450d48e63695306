"""Optimizer steps without torch: how many a run takes (``algebra``), how each one is carried out
(``strategy``) and the learning rate of each (``schedule``). Both ``apr.plan`` and ``apr.train`` read
these, so the plan and the trainer cannot disagree (docs/design.md, "Layers").
"""
