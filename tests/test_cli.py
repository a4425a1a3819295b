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


# --- first contact: call TOOL --help, checks before the model loads, no progress bars in pipes ------------------
def run_cli_with_cache(cache, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ATTENTION_EXPLAINER_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "agent_tools.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_call_tool_help_prints_every_argument_and_the_example(tmp_path) -> None:
    from agent_tools.tools import get_tool

    result = run_cli_with_cache(tmp_path, "call", "ablate_heads", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    spec = get_tool("ablate_heads")
    for name in spec.input_model.model_fields:
        assert f"\n  {name}: " in text, name
    assert "  top_k: integer, default 5, 1..50\n" in text
    assert "  text: string, required\n" in text
    assert "  heads: list of (string | {layer, head} | [integer, integer]), required, items ≥ 1\n" in text
    assert "positions with the largest effect listed" in text
    assert f"attention-explainer call ablate_heads --json '{json.dumps(spec.example)}'" in text
    listing = run_cli_with_cache(tmp_path, "call", "--help")
    assert listing.returncode == 0
    from agent_tools.tools import TOOLS

    assert [line.split(":")[0] for line in listing.stdout.splitlines()[2:] if not line.startswith(" ")] == list(TOOLS)


def test_a_typo_is_answered_without_importing_torch(tmp_path) -> None:
    # the first call builds the argument catalogue (it imports the tools anyway); later ones check against it
    assert run_cli_with_cache(tmp_path, "call", "show_attention", "--help").returncode == 0
    probe = (
        "import sys, agent_tools.cli as cli\n"
        "code = cli.main(['call', 'show_attention', '--json', '{\"text\": \"hi\", \"layr\": 3, \"head\": 0}'])\n"
        "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "ATTENTION_EXPLAINER_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "2 []", done.stderr
    assert "unknown argument 'layr' (did you mean 'layer'?" in done.stderr
    assert "layer: Field required" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    wrong_tool = run_cli_with_cache(tmp_path, "call", "show_atention", "--json", "{}")
    assert wrong_tool.returncode == 2 and "did you mean 'show_attention'?" in wrong_tool.stderr


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"text": "hi", "layr": 3, "head": 0}, "unknown argument 'layr'"),
        ({"text": "hi", "layer": 3, "head": 0, "top_k": 99}, "top_k 99 out of range 1..20"),
        ({"text": "hi", "heads": [[3]]}, "heads[0] [3] is not a head"),
        (
            {"text": "hi", "heads": ["3.0"], "method": "avg"},
            "method: Input should be 'mean'",
        ),
    ],
)
def test_arguments_are_checked_before_the_model_loads(tmp_path, monkeypatch, capsys, arguments, expected) -> None:
    from agent_tools import cli
    from agent_tools.inspector import Inspector

    loads: list[str | None] = []

    def no_loading(self, reference=None):
        loads.append(reference)
        raise RuntimeError("the model loader was called")

    monkeypatch.setenv("ATTENTION_EXPLAINER_CACHE", str(tmp_path))
    monkeypatch.setattr(Inspector, "model", no_loading)
    tool = "ablate_heads" if "heads" in arguments else "show_attention"
    for warm in (False, True):  # without the cached catalogue (the tool's own validation), then with it
        assert cli.main(["call", tool, "--json", json.dumps(arguments)]) == 2
        assert expected in capsys.readouterr().err, warm
    assert loads == []
    valid = {"text": "hi", "layer": 3, "head": 0}  # the same path with valid arguments does reach the loader
    with pytest.raises(RuntimeError, match="the model loader was called"):
        cli.main(["call", "show_attention", "--json", json.dumps(valid)])
    assert loads == [None]


def test_loading_a_model_prints_no_progress_bar(tmp_path) -> None:
    from families import build_family, tiny_tokenizer

    folder = tmp_path / "tiny"
    build_family("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    result = run_cli_with_cache(tmp_path / "cache", "describe", "--model", str(folder))
    assert result.returncode == 0, result.stderr
    assert "llama" in result.stdout
    assert "Loading weights" not in result.stderr and "it/s" not in result.stderr and "%|" not in result.stderr


@pytest.mark.slow
def test_the_one_time_gguf_conversion_says_one_line(tmp_path) -> None:
    from agent_tools.placement import Placement, dtype_name, resolve_dtype

    result = run_cli_with_cache(
        tmp_path, "call", "show_attention", "--json", '{"text": "hi", "layer": 0, "head": 0}'
    )  # reads the weights (describe reads the config only)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no tqdm bar: not for dequantising, loading or writing shards
    dtype = dtype_name(resolve_dtype(Placement()))  # auto: bfloat16 on a CPU with bfloat16 hardware, else float32
    size = {"float32": 513, "bfloat16": 257}[dtype]  # 134.5 M parameters at 4 or 2 bytes
    assert lines[0].startswith(f"converting SmolLM2-135M-Instruct.Q4_1 once: {size} MiB of {dtype} weights to ")
    assert lines[0].endswith(f"{tmp_path / 'gguf'}, ~20 s")
    again = run_cli_with_cache(tmp_path, "call", "show_attention", "--json", '{"text": "hi", "layer": 0, "head": 0}')
    assert again.returncode == 0 and again.stderr == ""  # converted once


@pytest.mark.parametrize("flavour", ["mcp", "openai-strict", "gemini"])
def test_tools_prints_the_schemas_in_each_flavour(capsys, flavour) -> None:
    from agent_tools import cli
    from agent_tools.surfaces.portable import portable_schema
    from agent_tools.tools import TOOLS

    assert cli.main(["tools", "--json-schemas", "--flavour", flavour]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {name: portable_schema(spec.input_model, flavour) for name, spec in TOOLS.items()}


def test_load_progress_is_rich_only_on_a_terminal_and_never_inside_a_callers_display(monkeypatch) -> None:
    import transformers.modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    from agent_tools.loading import caller_shows_progress, quiet_transformers

    before = (hf_logging.is_progress_bar_enabled(), gguf.tqdm, getattr(hf_logging, "_tqdm_hook", None))
    with quiet_transformers():  # stderr is captured here: not a terminal
        assert not hf_logging.is_progress_bar_enabled() and hf_logging._tqdm_hook is None
        assert gguf.tqdm is hf_logging.tqdm  # the GGUF reader's own tqdm obeys the switch too
        assert list(gguf.tqdm(range(3), desc="Converting")) == [0, 1, 2]
    assert (hf_logging.is_progress_bar_enabled(), gguf.tqdm, getattr(hf_logging, "_tqdm_hook", None)) == before
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with quiet_transformers():
        assert hf_logging._tqdm_hook is not None
        bar = gguf.tqdm(range(4), desc="Converting")
        assert list(bar) == [0, 1, 2, 3] and bar.progress.tasks[0].completed == 4
    with caller_shows_progress(), quiet_transformers():
        assert hf_logging._tqdm_hook is None
    assert (hf_logging.is_progress_bar_enabled(), gguf.tqdm, getattr(hf_logging, "_tqdm_hook", None)) == before


# --- issue 28: every usage error before the model loads, the concise text, text handles across calls ----------
EARLY_CASES = [
    (
        "show_attention",
        {"text": "hi", "layer": 18, "head": "18,6"},
        ["'18,6' looks like layer 18, head 6", '"layer": 18, "head": 6'],
    ),
    (
        "show_attention",
        {"text": "hi", "layer": 99, "head": 0},
        ["layer 99 out of range 0..29", "the model has 30 layers"],
    ),
    ("show_attention", {"text": "hi", "layer": 3, "head": 9}, ["head 9 out of range 0..8"]),
    ("show_attention", {"text": "hi", "layer": 1.5, "head": 0}, ["layer: expected integer, got 1.5", "a whole number"]),
    ("show_attention", {"text": "hi", "layer": 3, "head": 0, "detail": "all"}, ["'summary' or 'full' (got 'all')"]),
    (
        "diagnose_collapse",
        {"text": "hi", "layers": "18"},
        ['layers: expected list of integer, got "18"', '"18" -> [18]'],
    ),
    ("diagnose_collapse", {"text": "hi", "layers": [3, 30]}, ["layers item 30 out of range 0..29"]),
    (
        "ablate_heads",
        {"text": "hi", "heads": ["40.1", [2, 10]]},
        ["layer 40 out of range 0..29", "head 10 out of range 0..8"],
    ),
    ("show_attention", {"text": "word " * 140_000, "layer": 3, "head": 0}, ["(8,192 tokens at most)", "stream texts"]),
    ("show_atention", {}, ["did you mean 'show_attention'?"]),
]


def test_usage_errors_answer_before_torch_and_name_the_fix(tmp_path) -> None:
    probe = (
        "import json, sys, agent_tools.cli as cli\n"
        "for tool, arguments in json.loads(sys.stdin.read()):\n"
        "    print(cli.main(['call', tool, '--json', json.dumps(arguments)]), file=sys.stderr)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'pydantic') if m in sys.modules))\n"
    )
    cases = json.dumps([[tool, arguments] for tool, arguments, _ in EARLY_CASES])
    env = {**os.environ, "ATTENTION_EXPLAINER_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", probe], input=cases, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.stdout.strip() == "[]", done.stderr  # no torch, no transformers, not even pydantic
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 * len(EARLY_CASES), done.stderr  # one error line and exit code 2 per case
    for index, (_, _, fragments) in enumerate(EARLY_CASES):
        message, code = lines[2 * index], lines[2 * index + 1]
        assert code == "2" and message.startswith("error: "), message
        assert all(fragment in message for fragment in fragments), message


def test_the_catalogue_is_the_declarations_and_imports_no_torch(tmp_path) -> None:
    """``call``'s ``--help`` and checks read the tools' declaration data (equal to the registry,
    tests/test_mcp_startup.py): a fresh process with an empty cache folder answers without importing torch."""
    from agent_tools.surfaces.portable import portable_schema
    from agent_tools.tool_declarations import tool_declarations
    from agent_tools.tools import TOOLS

    tools = tool_declarations()
    assert list(tools) == list(TOOLS)
    for name, spec in TOOLS.items():
        example = json.loads(json.dumps(spec.example))
        entry = tools[name]
        assert (entry["description"], entry["example"]) == (spec.description, example)
        assert entry["input_schema"] == portable_schema(spec.input_model, "mcp")
    probe = (
        "import sys, agent_tools.cli as cli\n"
        "code = cli.main(['call', 'show_attention', '--help'])\n"
        "print(code, sorted(m for m in ('torch', 'transformers', 'agent_tools.tools') if m in sys.modules))\n"
    )
    env = {**os.environ, "ATTENTION_EXPLAINER_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("0 []"), done.stdout  # answered, nothing heavy imported
    assert "attention-explainer call show_attention --json ARGS" in done.stdout
    assert '0-based integers given apart ("layer": 18, "head":' in done.stdout  # the shared arguments' meaning
    assert not list(tmp_path.iterdir())  # nothing built or cached


def test_known_facts_are_the_bundled_models_own(smol, minilm) -> None:
    from agent_tools.cli import catalogue

    for name, loaded in (("smollm2-135m-instruct", smol), ("minilm-l6", minilm)):
        facts = loaded.facts
        assert catalogue.KNOWN_FACTS[name] == {
            "layers": facts.num_layers,
            "heads": facts.num_heads,
            "positions": facts.max_positions,
        }


def test_facts_from_a_local_config_without_torch(tmp_path) -> None:
    from agent_tools.cli import catalogue

    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 4, "n_head": 2, "n_positions": 64}))
    assert catalogue.model_facts(str(tmp_path)) == {"name": str(tmp_path), "layers": 4, "heads": 2, "positions": 64}
    schema = {"properties": {"layer": {"type": "integer"}, "text": {"type": "string"}}}
    problems = catalogue.precheck(
        "t", {"layer": 4, "text": "x" * 5000}, schema, facts=catalogue.model_facts(str(tmp_path))
    )
    assert problems[0].startswith("layer 4 out of range 0..3") and "text of 5,000 characters" in problems[1]


def test_call_prints_the_concise_text_and_its_handles_run_in_the_next_call(tmp_path, monkeypatch, capsys) -> None:
    from agent_tools import cli
    from agent_tools.surfaces import concise_text
    from agent_tools.tools import TOOLS

    monkeypatch.setenv("ATTENTION_EXPLAINER_CACHE", str(tmp_path))
    text = "The cat sat on the mat because it was tired, and the dog slept by the door until the sun went down. " * 3
    arguments = {"text": text, "layer": 3, "head": 0}
    assert cli.main(["--artifacts", str(tmp_path), "call", "show_attention", "--json", json.dumps(arguments)]) == 0
    report = TOOLS["show_attention"].output_model.model_validate_json(capsys.readouterr().out)
    assert (
        cli.main(["--artifacts", str(tmp_path), "call", "show_attention", "--text", "--json", json.dumps(arguments)])
        == 0
    )
    printed = capsys.readouterr().out
    assert printed == concise_text(report) + "\n"  # exactly what MCP and LangChain send
    assert len(printed.encode()) <= 2048 and text not in printed
    handle = report.next_calls[1].arguments["text"]
    assert handle.startswith("@text:") and report.next_calls[1].tool == "diagnose_collapse"
    line = next(line for line in printed.splitlines() if line.startswith("next: diagnose_collapse "))
    tool, _, rest = line.removeprefix("next: ").partition(" ")
    suggested = json.JSONDecoder().raw_decode(rest)[0]  # the call as printed, run by a new process's session
    assert (
        cli.main(["--artifacts", str(tmp_path), "call", tool, "--format", "json", "--json", json.dumps(suggested)]) == 0
    )
    followed = json.loads(capsys.readouterr().out)
    direct = {**suggested, "text": text}  # the same call with the text itself: the same report
    assert cli.main(["--artifacts", str(tmp_path), "call", tool, "--json", json.dumps(direct)]) == 0
    assert json.loads(capsys.readouterr().out)["summary"] == followed["summary"]
    unknown = cli.main(["call", "diagnose_collapse", "--json", json.dumps({"text": "@text:0123456789abcdef"})])
    assert unknown == 2 and "names no text this session has seen" in capsys.readouterr().err
