"""The operator's placement (dtype, device, device map, memory, offload, quantization) on every surface: the CLI's
global options and ``mcp``, ``AttentionToolkit``, ``ToolDispatcher`` and ``Inspector``; bad values are one clear
line (exit 2, a tool error); no tool argument can change the placement; every report states dtype and device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mcp_process import ENV, ROOT
from pydantic import ValidationError

from agent_tools import cli
from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import loaded_models
from agent_tools.placement import Placement
from agent_tools.surfaces.langchain import AttentionToolkit
from agent_tools.surfaces.openai import ToolDispatcher
from agent_tools.tools import TOOLS, get_tool

NO_CUDA = not torch.cuda.is_available()
NO_MPS = not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "agent_tools.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--dtype", "int8"), ("invalid choice: 'int8'", "auto", "float32", "bfloat16", "float16")),
        (("--device-map", "everywhere"), ("invalid choice: 'everywhere'", "auto", "balanced", "sequential")),
        (("--quantization", "2bit"), ("invalid choice: '2bit'", "8bit", "4bit")),
    ],
)
def test_cli_flags_outside_their_choices_are_usage_errors(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*flags, "tools"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert all(word in err for word in message), err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--device", "tpu"), "auto, cpu, cuda, cuda:N, mps"),
        (("--max-memory", "0=lots"), "e.g. 0=70GiB,1=70GiB,cpu=100GiB"),
        (("--device-map", "auto", "--max-memory", "cpu"), "DEVICE=SIZE"),
        (("--max-memory", "cpu=1GiB"), "only apply with a device map; add one of: auto, balanced, sequential"),
        pytest.param(("--device", "cuda"), "CUDA", marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA present")),
        pytest.param(("--device", "mps"), "MPS", marks=pytest.mark.skipif(not NO_MPS, reason="MPS present")),
        pytest.param(("--quantization", "8bit"), "CUDA", marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA")),
    ],
)
def test_cli_bad_placement_is_one_line_exit_2(flags, message, capsys) -> None:
    assert cli.main([*flags, "tools"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_cli_offload_folder_that_cannot_be_written(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    flags = ["--device-map", "sequential", "--offload-folder", str(blocker / "sub")]
    assert cli.main([*flags, "tools"]) == 2
    err = capsys.readouterr().err
    assert "offload" in err and str(blocker / "sub") in err and "Traceback" not in err


@pytest.mark.real_model
def test_cli_dtype_reaches_the_model_and_the_report() -> None:
    result = _cli("--dtype", "bfloat16", "call", "describe_model", "--json", json.dumps({"model": "minilm-l6"}))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["dtype"], report["device"], report["placement"]) == ("bfloat16", "cpu", "bfloat16@cpu")
    weights = report["weights_bytes"]
    # every parameter halves from float32 to bfloat16; buffers (position ids) keep their own size
    assert weights["bfloat16"] == weights["float16"] < weights["float32"] < 2 * weights["bfloat16"] + 10_000
    assert weights["float32"] == pytest.approx(4 * report["num_parameters"], rel=1e-3)


def test_mcp_server_with_a_bad_placement_exits_at_once(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "agent_tools.cli", "--artifacts", str(tmp_path), "mcp", "--device", "tpu:0"]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=str(ROOT), timeout=60, stdin=None)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "auto, cpu, cuda, cuda:N, mps" in result.stderr
    assert "Traceback" not in result.stderr


def test_mcp_placement_flags_override_the_global_ones() -> None:
    args = cli.build_parser().parse_args(["--dtype", "float16", "mcp", "--dtype", "bfloat16", "--no-preload"])
    assert cli.session_from_args(args).placement.dtype == "bfloat16"
    args = cli.build_parser().parse_args(["--dtype", "float16", "mcp", "--no-preload"])
    assert cli.session_from_args(args).placement.dtype == "float16"


def test_toolkit_and_dispatcher_take_the_placement() -> None:
    toolkit = AttentionToolkit(dtype="bfloat16")
    assert toolkit.session.placement == Placement(dtype="bfloat16")
    assert ToolDispatcher(dtype="float16").inspector.placement == Placement(dtype="float16")
    assert Inspector().placement == Placement()
    with pytest.raises(InvalidInputError, match="auto, cpu, cuda, cuda:N, mps"):
        ToolDispatcher(device="tpu")
    with pytest.raises(ValidationError, match="unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N, mps"):
        AttentionToolkit(device="tpu")  # pydantic wraps the toolkit's own InvalidInputError
    with pytest.raises(ValueError, match="not both"):
        ToolDispatcher(Inspector(), dtype="float16")


@pytest.mark.parametrize("name", list(TOOLS))
def test_no_tool_argument_can_change_the_placement(name: str) -> None:
    fields = set(TOOLS[name].input_model.model_fields)
    assert not fields & {"dtype", "device", "device_map", "max_memory", "offload_folder", "quantization"}
    arguments = {**TOOLS[name].example, "dtype": "float16", "device": "cuda"}
    with pytest.raises(AttentionToolError, match="unknown argument 'device'"):
        TOOLS[name].parse(arguments)


def test_every_report_states_dtype_and_device(tiny_models, inspector: Inspector) -> None:
    report = get_tool("describe_model")(inspector, {"model": "tiny-llama"})
    assert (report.dtype, report.device) == ("float32", "cpu")
    show = get_tool("show_attention")(inspector, {"model": "tiny-llama", "text": "the cat sat", "layer": 0, "head": 1})
    assert (show.dtype, show.device) == ("float32", "cpu")
    model = tiny_models["llama"].model
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert report.weights_bytes["float32"] == 4 * sum(p.numel() for p in model.parameters()) + buffers
    assert report.weights_bytes["bfloat16"] == 2 * sum(p.numel() for p in model.parameters()) + buffers


def test_a_refused_load_leaves_nothing_in_the_cache() -> None:
    before = set(loaded_models())
    with pytest.raises(InvalidInputError):
        Inspector(placement=Placement(device="tpu"))
    assert set(loaded_models()) == before
