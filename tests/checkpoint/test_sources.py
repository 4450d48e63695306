"""The one reader of weight sources: an apr checkpoint (by its JSON, its .safetensors or a part
file), a sharded run's parts, a run directory, a Hugging Face folder single or sharded, a bare
.safetensors file; each gives the same tensors and architecture, and anything else is refused
naming the path, what was expected and what was found."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from apr.checkpoint.manager import read_checkpoint  # noqa: E402
from apr.checkpoint.sources import SourceError, open_source  # noqa: E402
from tests.checkpoint.test_parts import save_sharded  # noqa: E402
from tests.generate.tiny_lm import shard_hf  # noqa: E402

NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def sources(untrained_lm, tmp_path_factory):
    """Every kind of source holding the same weights: kind -> path."""
    root = tmp_path_factory.mktemp("sources")
    state = read_checkpoint(untrained_lm.checkpoint)
    save_sharded(root / "parts", untrained_lm.config, dict(state.tensors), untrained_lm.steps, world=3)
    parts = root / "parts" / f"checkpoint-step-{untrained_lm.steps}.part-1-of-3.safetensors"
    assert parts.is_file()
    return {"checkpoint": untrained_lm.checkpoint, "weights file": untrained_lm.checkpoint.with_suffix(".safetensors"),
            "run": untrained_lm.run_dir, "parts run": root / "parts", "part file": parts,
            "hf": untrained_lm.hf_dir, "hf sharded": shard_hf(untrained_lm.hf_dir, root / "hf-sharded")}


def test_every_kind_holds_the_same_weights_and_implies_the_same_architecture(sources, untrained_lm):
    opened = {k: open_source(p) for k, p in sources.items()}
    kinds = {k: (s.kind, s.sharded) for k, s in opened.items()}
    assert kinds == {"checkpoint": ("checkpoint", False), "weights file": ("checkpoint", False),
                     "run": ("run", False), "parts run": ("run", True), "part file": ("checkpoint", True),
                     "hf": ("hf", False), "hf sharded": ("hf", True)}
    assert len(opened["hf sharded"].files) == 2 and len(opened["parts run"].files) == 3
    want = untrained_lm.config.model.architecture
    want_tensors = {n: t for n, t in read_checkpoint(untrained_lm.checkpoint).tensors.items()
                    if not n.startswith("optimizer.")}
    for kind, source in opened.items():
        assert source.architecture() == want, kind
        assert sorted(source.names) == sorted(want_tensors), kind  # AdamW moments are not weights
        assert source.step == (None if kind.startswith("hf") else untrained_lm.steps), kind
        assert source.shape(NAME) == tuple(want_tensors[NAME].shape), kind
        assert torch.equal(source.rows(NAME, 3, 7), want_tensors[NAME][3:7]), kind
        got = source.read(dtype=torch.float32)
        assert all(torch.equal(got[n], t) for n, t in want_tensors.items()), kind
    assert opened["checkpoint"].apr_config().model.architecture == want
    assert opened["hf"].apr_config() is None and opened["hf sharded"].hf_config()["model_type"] == "llama"


def test_opening_reads_headers_only_without_torch(sources):
    """What a plan reads (``model.init_from``, a teacher): names, shapes and the architecture, torch never imported."""
    paths = json.dumps(json.dumps({k: str(v) for k, v in sources.items()}))
    code = ("import sys, json; from apr.checkpoint.sources import open_source\n"
            "out = {}\n"
            f"for kind, path in json.loads({paths}).items():\n"
            "    s = open_source(path, verify=False)\n"
            "    out[kind] = [s.architecture().hidden_size, list(s.shape('model.norm.weight'))]\n"
            "print(json.dumps(out)); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(v == [64, [64]] for v in json.loads(lines[0]).values()) and lines[1] == "False"


def _copy(untrained_lm, tmp_path, name="hf"):
    return shard_hf(untrained_lm.hf_dir, tmp_path / name)


def _edit_index(folder, edit):
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    edit(doc)
    index.write_text(json.dumps(doc))


def _missing_shard(untrained_lm, tmp_path):
    folder = _copy(untrained_lm, tmp_path)
    (folder / "model-00002-of-00002.safetensors").unlink()
    return folder


def _moved_tensor(untrained_lm, tmp_path):
    folder = _copy(untrained_lm, tmp_path)
    _edit_index(folder, lambda d: d["weight_map"].update({NAME: "model-00002-of-00002.safetensors"}
                                                          if d["weight_map"][NAME].startswith("model-00001")
                                                          else {NAME: "model-00001-of-00002.safetensors"}))
    return folder


def _outside(untrained_lm, tmp_path):
    folder = _copy(untrained_lm, tmp_path)
    _edit_index(folder, lambda d: d["weight_map"].update({NAME: "../model-00001-of-00002.safetensors"}))
    return folder


def _pickle_shard(untrained_lm, tmp_path):
    folder = _copy(untrained_lm, tmp_path)
    _edit_index(folder, lambda d: d["weight_map"].update({NAME: "pytorch_model-00001.bin"}))
    return folder


def _no_weights(untrained_lm, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(untrained_lm.hf_dir, folder)
    (folder / "model.safetensors").unlink()
    return folder


def _pickle_only(untrained_lm, tmp_path):
    folder = _no_weights(untrained_lm, tmp_path)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    return folder


@pytest.mark.parametrize("make, code, said", [
    (lambda lm, p: p / "missing", "source.missing", "no such file or folder"),
    (lambda lm, p: (p / "notes.txt").write_text("x") and p / "notes.txt", "source.unknown", "a .txt file"),
    (lambda lm, p: (p / "w.safetensors").write_bytes(b"\x08garbage") and p / "w.safetensors", "source.bad_weights",
     "cannot be read as safetensors"),
    (lambda lm, p: (p / "empty").mkdir() or p / "empty", "source.no_checkpoint", "no checkpoint-step-*.json"),
    (lambda lm, p: (p / "checkpoint-step-1.json").write_text("{}") and p / "checkpoint-step-1.json",
     "checkpoint.not_apr", "not an apr checkpoint"),
    (_missing_shard, "source.missing_shard", "model-00002-of-00002.safetensors"),
    (_moved_tensor, "source.bad_index", f"puts {NAME} in"),
    (_outside, "source.bad_index", "outside its folder"),
    (_pickle_shard, "source.pickle", "never unpickles"),
    (_no_weights, "source.no_weights", "has config.json but no model.safetensors"),
    (_pickle_only, "source.pickle", "pytorch_model.bin"),
])
def test_what_is_not_a_weight_source_is_refused_naming_path_and_what_was_found(untrained_lm, tmp_path, make, code,
                                                                               said):
    path = make(untrained_lm, tmp_path)
    for verify in (True, False):
        with pytest.raises(SourceError) as err:
            open_source(path, verify=verify)
        f = err.value.findings[0]
        assert said in err.value.message and f.code == code, (err.value.message, f.code)
        assert f.file and str(tmp_path) in f.file


def test_a_bare_safetensors_file_has_tensors_but_no_architecture(untrained_lm, tmp_path):
    bare = tmp_path / "w.safetensors"
    shutil.copy(untrained_lm.checkpoint.with_suffix(".safetensors"), bare)
    source = open_source(bare)
    assert source.kind == "safetensors" and NAME in source.names  # the optimizer's tensors are in it too here
    with pytest.raises(SourceError, match="nothing says which model"):
        source.architecture()
    folder = tmp_path / "hf"
    shutil.copytree(untrained_lm.hf_dir, folder)
    (folder / "config.json").unlink()
    with pytest.raises(SourceError, match="no config.json") as err:
        open_source(folder).architecture()
    assert err.value.findings[0].code == "source.no_config"


def test_a_damaged_checkpoint_is_refused_unless_shown_with_a_warning(untrained_lm, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(untrained_lm.run_dir, run)
    weights = run / untrained_lm.checkpoint.with_suffix(".safetensors").name
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last weight flipped: same size, another SHA-256
    weights.write_bytes(bytes(data))
    named = run / untrained_lm.checkpoint.name
    with pytest.raises(SourceError, match="SHA-256"):
        open_source(named)
    said: list[str] = []
    assert open_source(named, warn=said.append, show_damaged=True).step == untrained_lm.steps
    assert len(said) == 1 and "SHA-256" in said[0] and "not the weights" in said[0]
    with pytest.raises(SourceError, match="all 1 are damaged") as err:  # a run folder passes over it
        open_source(run, warn=said.append)
    assert "SHA-256" in err.value.findings[0].message and "SHA-256" in said[-1] and len(said) == 2
    assert open_source(named, verify=False).step == untrained_lm.steps  # headers only: what a plan reads


def test_every_command_page_names_the_same_sources_and_the_refusals_are_documented():
    """One list of sources in every command's page, and one table row per refusal the reader raises."""
    import re
    from pathlib import Path

    import apr.checkpoint.sources as sources_module

    docs = Path(__file__).resolve().parents[2] / "docs"
    listed = ("an apr checkpoint (`checkpoint-step-N.json`, its `.safetensors` or a part file), a run directory "
              "(its newest usable checkpoint) or a Hugging Face folder (`model.safetensors`, or the shards of a "
              "`model.safetensors.index.json`)")
    for page in ("generate.md", "eval.md", "inspect.md", "profile.md"):
        assert listed in " ".join((docs / page).read_text().split()), page
    assert "checkpoints.md#weight-sources-what-every-command-reads" in (docs / "finetuning.md").read_text()
    text = (docs / "checkpoints.md").read_text()
    section = text[text.index("## Weight sources"):text.index("## Changing the config on resume")]
    code = Path(sources_module.__file__).read_text()
    raised = set(re.findall(r'_refuse\([^,]+, "(\w+)"', code)) | set(re.findall(r'"source\.(\w+)"', code))
    documented = set(re.findall(r"`source\.(\w+)`", section))
    assert raised == documented
    kinds = set(re.findall(r"^\| [^|]+ \| `(\w+)` \|", section, re.M))
    assert kinds == {"checkpoint", "run", "hf", "safetensors"}
