"""Facts about the tokenizer named by ``data.tokenizer`` (a Hugging Face ``tokenizer.json``)."""

from __future__ import annotations

import hashlib

from apr.errors import AprError
from apr.plan.datafacts import resolve
from apr.readers import InputError, check_regular, decode_utf8, read_bytes


def tokenizer_facts(path_text: str, manifests: list[dict] | None = None) -> dict:
    """path, exists, loaded, and when it loads: vocab_size (with added tokens), base and added
    counts, the file's sha256; with ``manifests`` (``datafacts.data_manifests``, the tokenizer
    each dataset was made with), ``data``: the first one made with another tokenizer, else the first."""
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
        raw = read_bytes(path, "tokenizer", "tokenizer")  # bounded: size, FIFOs, devices
        tok = Tokenizer.from_str(decode_utf8(raw, str(path), "tokenizer"))
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
    facts["sha256"] = hashlib.sha256(raw).hexdigest()  # as `apr data pretokenize` records it
    if manifests:
        facts["data"] = made_with(manifests, facts["sha256"], tok)
    return facts


def made_with(manifests: list[dict], sha256: str, tok) -> dict:
    """The data's tokenizer against this one: the first manifest whose digest differs (else the
    first), with ``matches`` and, for its end-of-text token, the id this tokenizer gives it
    (``eot_id_here``, -1 when it has no such token) and a phrase saying how they differ."""
    chosen = next((m for m in manifests if m["sha256"] != sha256), manifests[0])
    out = {**chosen, "matches": chosen["sha256"] == sha256, "special": ""}
    eot, eot_id = chosen.get("eot_token"), chosen.get("eot_id")
    if eot is not None and eot_id is not None:
        here = tok.token_to_id(eot)
        out["eot_id_here"] = -1 if here is None else here
        if here != eot_id:
            out["special"] = (f"; its end-of-text token {eot!r} is id {eot_id} in the data and "
                              + (f"id {here} in this tokenizer" if here is not None else "absent from this tokenizer"))
    return out
