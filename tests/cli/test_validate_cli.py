import json
import subprocess
import sys

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def test_valid_config_exits_zero(repo):
    result = runner.invoke(app, ["train", "validate", str(repo / "configs/train/pretrain-350m-v2.yaml")])
    assert result.exit_code == 0, result.output
    assert "valid" in result.stdout


def test_json_output_is_a_findings_document(repo):
    result = runner.invoke(app, ["train", "validate", str(repo / "configs/train/demo-tiny.yaml"), "--json"])
    doc = json.loads(result.stdout)
    assert doc["format_version"] == "1" and doc["valid"] is True
    assert all({"severity", "code", "path", "line", "message"} <= set(f) for f in doc["findings"])


def test_usage_errors_exit_two():
    assert runner.invoke(app, ["train", "validate"]).exit_code == 2
    assert runner.invoke(app, ["train", "validate", "a.yaml", "--bogus"]).exit_code == 2


def _real_apr(*args, cwd=None):
    code = "import sys; from apr.cli.entry import run; sys.argv = ['apr', *sys.argv[1:]]; run()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd)


def test_real_process_never_imports_torch_and_shows_no_traceback(repo, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  architecture:\n    hidden_size: wide\n")
    probe = (
        "import sys; from apr.cli.entry import run; sys.argv = ['apr', 'train', 'validate', sys.argv[1]];\n"
        "try:\n    run()\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = [m for m in ('torch', 'pyarrow', 'tokenizers', 'textual') if m in sys.modules]\n"
        "print('HEAVY', heavy, 'EXIT', code)"
    )
    for cfg, exit_code in ((repo / "configs/train/pretrain-350m-v2.yaml", 0), (bad, 1)):
        out = subprocess.run([sys.executable, "-c", probe, str(cfg)], capture_output=True, text=True)
        assert f"HEAVY [] EXIT {exit_code}" in out.stdout, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
    result = _real_apr("train", "validate", str(bad))
    assert result.returncode == 1 and "model.architecture.hidden_size" in result.stderr
    assert ":3:" in result.stderr  # file:line:column


def test_schema_command_prints_json_schema():
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["title"] == "apr training config"
    assert "model" in doc["properties"] and "training" in doc["required"] or "model" in doc["required"]


def test_version_flag():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("apr ")


def test_config_only_contracts_run_in_validate_with_lines(tmp_path):
    """validate runs the contracts that need only the config (architecture, warmup vs max_steps, ...)."""
    cfg = tmp_path / "arch.yaml"
    cfg.write_text(
        "model:\n  architecture:\n    hidden_size: 66\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    intermediate_size: 200\n    vocab_size: 512\n    max_position_embeddings: 64\n"
        "data:\n  train: t/\n  batch_size: 2\n  seq_len: 32\n"
        "training:\n  max_steps: 10\n  warmup_steps: 10\n")
    result = runner.invoke(app, ["train", "validate", str(cfg)])
    assert result.exit_code == 1
    err = result.stderr if result.stderr_bytes is not None else result.output
    assert f"error[C-ARCH-001] {cfg}:3:5 model.architecture.hidden_size:" in err
    assert f"error[C-TRAINCFG-008] {cfg}:15:3" in err
    assert "warning[C-ARCH-007]" in err
    assert "C-DATA-" not in err and "info[" not in err  # data contracts need plan; info is plan-only
    doc = json.loads(runner.invoke(app, ["train", "validate", str(cfg), "--json"]).stdout)
    codes = [f["code"] for f in doc["findings"]]
    assert doc["valid"] is False and codes[:2] == ["C-ARCH-001", "C-TRAINCFG-008"]


def test_validate_checks_memory_against_the_config_gpu(tmp_path):
    cfg = tmp_path / "big.yaml"
    cfg.write_text(
        "model:\n  architecture:\n    hidden_size: 4096\n    num_hidden_layers: 32\n    num_attention_heads: 32\n"
        "    intermediate_size: 11008\n    vocab_size: 32000\n    max_position_embeddings: 2048\n"
        "data:\n  train: t/\n  batch_size: 1\n  seq_len: 2048\n"
        "training:\n  gpu: t4\n")
    result = runner.invoke(app, ["train", "validate", str(cfg)])
    assert result.exit_code == 1
    assert "error[C-MEM-001]" in result.output and "NVIDIA T4 16GB" in result.output
    unknown = cfg.read_text().replace("gpu: t4", "gpu: tpu-v9")
    cfg.write_text(unknown)
    result = runner.invoke(app, ["train", "validate", str(cfg)])
    assert result.exit_code == 1 and 'error[C-MEM-003]' in result.output and ":14:3" in result.output


def test_validate_and_plan_refuse_the_same_bad_overrides(tmp_path, monkeypatch):
    """A setting validate accepts, plan accepts too, and the other way round: both read KEY=VALUE through
    the same layering and schema (a boolean for a number, a seed past int64, an unknown key)."""
    from apr.plan.examples import materialize

    config, _ = materialize({}, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    cases = {"optimizer.lr=true": ("schema.value_error", "optimizer.lr", "boolean"),
             f"training.seed={2**63}": ("schema.value_error", "training.seed", "2**63 - 1"),
             "training.lr=1e-3": ("schema.unknown_key", "training.lr", "did you mean 'optimizer.lr'?")}
    for setting, (code, path, text) in cases.items():
        for command in ("validate", "plan"):
            r = runner.invoke(app, ["train", command, str(config), setting, "--json"])
            findings = json.loads(r.stdout)["findings"]
            assert r.exit_code == 1, (command, setting, r.output)
            assert any(f["code"] == code and f["path"] == path and text in f["message"] and f["file"] == "command line"
                       for f in findings), (command, setting, findings)
    for command in ("validate", "plan"):  # and a good one passes both
        assert runner.invoke(app, ["train", command, str(config), "optimizer.lr=1e-3"]).exit_code == 0, command


def test_strict_fails_on_warnings_in_every_format_and_on_the_fast_path(tmp_path, capsys):
    from apr.cli.cmd_train_validate import fast_path

    cfg = tmp_path / "warn.yaml"
    cfg.write_text(  # intermediate_size 200: C-ARCH-007, a warning and nothing else
        "model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    intermediate_size: 200\n    vocab_size: 512\n    max_position_embeddings: 64\n"
        "data:\n  train: t/\n  batch_size: 2\n  seq_len: 32\n")
    relaxed = runner.invoke(app, ["train", "validate", str(cfg)])
    assert relaxed.exit_code == 0 and "valid (0 errors, 1 warnings)" in relaxed.stdout
    strict = runner.invoke(app, ["train", "validate", str(cfg), "--strict"])
    assert strict.exit_code == 1 and "fails --strict: warnings (0 errors, 1 warnings)" in strict.stdout
    doc = json.loads(runner.invoke(app, ["train", "validate", str(cfg), "--strict", "--json"]).stdout)
    assert doc["valid"] is True and doc["strict"] is True and doc["passed"] is False
    github = runner.invoke(app, ["train", "validate", str(cfg), "--strict", "--format", "github"])
    assert github.exit_code == 1 and "::warning " in github.stdout
    assert fast_path(["train", "validate", str(cfg), "--strict"]) == 1  # what the console script runs
    assert fast_path(["train", "validate", str(cfg)]) == 0
    capsys.readouterr()
