"""The CLI as the README runs it: exit codes and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "agent_tools.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_describe_and_call_json(tmp_path) -> None:
    result = run_cli("describe", "--model", "minilm-l6")
    assert result.returncode == 0, result.stderr
    assert "bert" in result.stdout and "bidirectional" in result.stdout
    result = run_cli(
        "call",
        "show_attention",
        "--json",
        json.dumps({"model": "minilm-l6", "text": "The cat sat.", "layer": 5, "head": 11}),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["layer"] == 5 and report["tokens"][0]["text"] == "[CLS]"


def test_show_writes_png(tmp_path) -> None:
    png = tmp_path / "map.png"
    result = run_cli(
        "show", "The cat sat on the mat.", "--layer", "2", "--head", "1", "--model", "minilm-l6", "--png", str(png)
    )
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("describe", "--model", "nope"), "bundled aliases"),
        (("show", " ", "--layer", "0", "--head", "0", "--model", "minilm-l6"), "empty"),
        (("show", "hi", "--layer", "6", "--head", "0", "--model", "minilm-l6"), "out of range 0..5"),
        (("call", "show_attention", "--json", "{not json"), "not valid JSON"),
        (("call", "no_tool", "--json", "{}"), "unknown tool"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.strip().splitlines() if line.startswith("error:")]) == 1


def test_help_and_usage_errors_do_not_import_torch() -> None:
    # The parser (every subcommand's options) builds from stdlib-only modules: --help answers at once.
    probe = (
        "import sys, agent_tools, agent_tools.cli as cli\n"
        "cli.build_parser().format_help()\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    usage = run_cli("show")
    assert usage.returncode == 2 and "required" in usage.stderr
