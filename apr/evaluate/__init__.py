"""Measuring a trained model: loss, perplexity and bits per byte over pretokenized shards
(``loss``), multiple-choice tasks from JSONL (``tasks``, ``multiple_choice``) and the shipped
``stdlib-nextline`` task (``stdlib_task``). See docs/eval.md."""
