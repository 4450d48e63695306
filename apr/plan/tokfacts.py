"""Facts about the tokenizer named by ``data.tokenizer`` (a Hugging Face ``tokenizer.json``)."""

from __future__ import annotations

from apr.plan.datafacts import resolve


def tokenizer_facts(path_text: str) -> dict:
    """path, exists, loaded, and when it loads: vocab_size (with added tokens), base and added counts."""
    path = resolve(path_text)
    facts: dict = {"path": path_text, "resolved": str(path), "exists": path.is_file()}
    if not facts["exists"]:
        facts["loaded"] = False
        facts["error"] = "a folder, not a tokenizer.json file" if path.is_dir() else "no such file"
        return facts
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses with a parse message
        facts["loaded"] = False
        facts["error"] = (str(e).splitlines() or [type(e).__name__])[0][:200]
        return facts
    facts["loaded"] = True
    facts["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    facts["base_vocab_size"] = tok.get_vocab_size(with_added_tokens=False)
    facts["added_tokens"] = facts["vocab_size"] - facts["base_vocab_size"]
    return facts
