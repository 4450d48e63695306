"""Facts about the tokenizer named by ``data.tokenizer`` (a Hugging Face ``tokenizer.json``)."""

from __future__ import annotations

from apr.errors import AprError
from apr.plan.datafacts import resolve
from apr.readers import InputError, check_regular, read_text


def tokenizer_facts(path_text: str) -> dict:
    """path, exists, loaded, and when it loads: vocab_size (with added tokens), base and added counts."""
    path = resolve(path_text)
    facts: dict = {"path": path_text, "resolved": str(path), "exists": path.is_file()}
    if not facts["exists"]:
        facts["loaded"] = False

        try:
            check_regular(path, "tokenizer")
            facts["error"] = "no such file"
        except InputError as e:  # says what is there instead: a folder, a FIFO, a symlink loop...
            f = e.findings[0]
            facts["error"] = "no such file" if f.code == "file.missing" else (f.got or e.message)
        return facts
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(read_text(path, "tokenizer", "tokenizer"))  # bounded: size, FIFOs, devices
    except AprError as e:
        facts["loaded"] = False
        facts["error"] = e.findings[0].message if e.findings else e.message
        return facts
    except Exception as e:  # the Rust side raises plain Exception subclasses with a parse message
        facts["loaded"] = False
        facts["error"] = (str(e).splitlines() or [type(e).__name__])[0][:200]
        return facts
    facts["loaded"] = True
    facts["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    facts["base_vocab_size"] = tok.get_vocab_size(with_added_tokens=False)
    facts["added_tokens"] = facts["vocab_size"] - facts["base_vocab_size"]
    return facts
