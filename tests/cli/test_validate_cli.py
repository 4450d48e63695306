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
