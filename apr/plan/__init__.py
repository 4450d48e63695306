"""Facts derived from config, data and tokenizer; contract evaluation; the Plan object."""
