"""One catalogue of bad inputs, run through every surface: the Python API, the LangChain toolkit, the MCP
server and the CLI.

Each case names a tool, its arguments and what must come back: an error of a given kind whose message names
what is valid (or, for control characters, a valid report) — never a traceback, a hang or a wrong report.
Every surface runs under the same configuration: the bundled models plus the bad model files below on the
allow-list, a token limit of 2048 and a memory budget of 64 MiB (set through each surface's own options).

The MCP server is one process for the whole module, driven by the official ``ClientSession`` over a plain
JSON-lines transport (``json.dumps``, as a client in any language writes it: lone surrogates go out as
``"\\ud800"`` escapes, NaN and infinity as null). The same session also checks that 8 concurrent requests give
exactly the results of the same requests made one after another. The CLI runs in-process through
``agent_tools.cli.main`` for every case and as a real subprocess for a few.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.text import TextReceiveStream
from langchain_core.messages import ToolMessage
from mcp import ClientSession, types
from mcp.shared.message import SessionMessage
from mcp_process import ENV, ROOT, server_command

from agent_tools import cli
from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Inspector
from agent_tools.loading import BUNDLED_MODELS, ModelPolicy, resolve_reference
from agent_tools.surfaces.langchain import AttentionToolkit
from agent_tools.tools import TOOLS

pytestmark = pytest.mark.real_model

SURFACES = ("python", "langchain", "mcp", "cli")
TOKEN_LIMIT = 2048
MEMORY_BUDGET_MIB = 64
TEXT = "The cat sat on the mat."
SHOW = {"text": TEXT, "layer": 3, "head": 0}
GENERATE = {"prompt": TEXT, "target": "generate"}
MILLION = "x" * 1_000_000
LONG_TEXT = "the cat " * 1500  # about 3000 tokens: tokenised, then refused
NEARLY_FULL = "the cat " * 1000  # about 2000 tokens: fits, but not with 200 more, nor as a full map in 64 MiB
CONTROL = "bell\x07 nul\x00 escape\x1b[31m delete\x7f tab\t form\x0c end"
CALL_TIMEOUT_S = 120  # a call that takes longer counts as a hang


@dataclass(frozen=True)
class Expect:
    kind: str | None  # the error kind; None = a valid report
    fragments: tuple[str, ...] = ()  # each must appear in the error text: they name what is valid


@dataclass(frozen=True)
class Case:
    id: str
    tool: str
    arguments: dict[str, Any]
    expect: Expect
    by_surface: dict[str, Expect] = field(default_factory=dict)  # where a surface's own policy answers differently
    surfaces: tuple[str, ...] = SURFACES

    def expected(self, surface: str) -> Expect:
        return self.by_surface.get(surface, self.expect)


def error(kind: str, *fragments: str) -> Expect:
    return Expect(kind, fragments)


INVALID, NOT_FOUND, REFUSED, LIMIT = "invalid_input", "model_not_found", "model_refused", "resource_limit"
EMPTY = "is empty or whitespace only; give at least one word"
NOT_UNICODE = "holds characters that are not valid Unicode"
POSITIVE = "temperatures.0: Input should be greater than 0"
FINITE = "temperatures.0: Input should be a finite number"  # over JSON NaN and ±inf arrive as null: same words
NEW_TOKENS = "out of range 1..256"
BUNDLED = "bundled aliases: minilm-l6, smollm2-135m-instruct"
# A path that is not on the allow-list: refused by the policy where there is one (the CLI user's own call has none).
NOT_ALLOWED = {
    "langchain": error(INVALID, "model: Input should be", "'smollm2-135m-instruct'"),
    "cli": error(NOT_FOUND, "holds no model (no config.json)"),
}


def model(placeholder: str) -> dict[str, str]:
    """A ``model`` argument naming one of the bad model files (resolved to a path in the module's folder)."""
    return {"model": f"@{placeholder}"}


CATALOGUE = [
    # --- a value of the wrong form: the error names the fix (the same words on every surface) ------------------
    Case(
        "head_as_layer_and_head",
        "show_attention",
        {**SHOW, "head": "18,6"},
        error(INVALID, "'18,6' looks like layer 18, head 6", 'use "layer": 18, "head": 6'),
    ),
    Case(
        "layers_as_a_string", "diagnose_collapse", {"text": TEXT, "layers": "18"}, error(INVALID, "layers", "-> [18]")
    ),
    # --- text ---------------------------------------------------------------------------------------------------
    Case("empty_text", "show_attention", {**SHOW, "text": ""}, error(INVALID, f"text {EMPTY}")),
    Case("whitespace_text", "show_attention", {**SHOW, "text": " \n\t  "}, error(INVALID, f"text {EMPTY}")),
    Case("whitespace_variant", "compare_prompts", {"prompt_a": TEXT, "prompt_b": "   "}, error(INVALID, EMPTY)),
    Case(
        "whitespace_message",
        "trace_prompt_attention",
        {"prompt": [{"role": "user", "content": " \n "}]},
        error(INVALID, EMPTY),
    ),
    Case(
        "empty_message_list",
        "trace_prompt_attention",
        {"prompt": []},
        error(INVALID, "give plain text or at least one {role, content} message"),
    ),
    Case(
        "million_characters",
        "show_attention",
        {**SHOW, "text": MILLION},
        error(LIMIT, f"text of 1,000,000 characters exceeds the token limit of {TOKEN_LIMIT} tokens"),
        by_surface={
            "cli": error(
                LIMIT,
                "text of 1,000,000 characters",
                f"is longer than the model reads ({TOKEN_LIMIT:,} tokens at most)",
            )
        },  # before loading
    ),
    Case(
        "million_characters_profile",
        "profile_heads",
        {"text": MILLION, "layers": [0]},
        error(LIMIT, f"exceeds the token limit of {TOKEN_LIMIT} tokens"),
        by_surface={"cli": error(LIMIT, f"is longer than the model reads ({TOKEN_LIMIT:,} tokens at most)")},
    ),
    Case(
        "over_token_limit",
        "show_attention",
        {**SHOW, "text": LONG_TEXT},
        error(LIMIT, f"accepts at most {TOKEN_LIMIT:,} tokens here"),
    ),
    Case(
        "generation_past_token_limit",
        "trace_prompt_attention",
        {**GENERATE, "prompt": NEARLY_FULL, "max_new_tokens": 200},
        error(LIMIT, f"+ max_new_tokens 200 exceeds {TOKEN_LIMIT} tokens", "use max_new_tokens <= "),
    ),
    Case(
        "one_token_trace",  # nothing to read but the sink: was a ValueError deep in the segment shares
        "trace_prompt_attention",
        {"prompt": "Hi"},
        error(INVALID, "prompt is 1 token; tracing needs at least 2 tokens"),
    ),
    Case(
        "one_token_variant",
        "compare_prompts",
        {"prompt_a": TEXT, "prompt_b": "Hi"},
        error(INVALID, "prompt_b is 1 token; tracing needs at least 2 tokens"),
    ),
    Case(
        "one_token_collapse",
        "diagnose_collapse",
        {"text": "Hi"},
        error(INVALID, "collapse needs at least 2 tokens"),
    ),
    Case("control_characters", "show_attention", {**SHOW, "text": CONTROL}, Expect(None)),
    Case("lone_surrogate", "show_attention", {**SHOW, "text": "ab\ud800cd"}, error(INVALID, NOT_UNICODE)),
    Case(
        "lone_surrogate_in_message",
        "trace_prompt_attention",
        {"prompt": [{"role": "user", "content": "hello \udfff"}]},
        error(INVALID, NOT_UNICODE),
    ),
    # --- layers and heads ---------------------------------------------------------------------------------------
    Case("layer_negative", "show_attention", {**SHOW, "layer": -1}, error(INVALID, "layer -1 out of range 0..29")),
    Case("layer_too_large", "show_attention", {**SHOW, "layer": 30}, error(INVALID, "layer 30 out of range 0..29")),
    Case("head_too_large", "show_attention", {**SHOW, "head": 9}, error(INVALID, "head 9 out of range 0..8")),
    Case("head_negative", "inspect_projections", {**SHOW, "head": -3}, error(INVALID, "head -3 out of range 0..8")),
    Case(
        "layer_as_word",
        "show_attention",
        {**SHOW, "layer": "three"},
        error(INVALID, "layer: Input should be a valid integer"),
        by_surface={"cli": error(INVALID, 'layer: expected integer, got "three"')},  # the catalogue, before loading
    ),
    Case(
        "layer_as_fraction",
        "reconstruct_attention",
        {**SHOW, "layer": 2.5},
        error(INVALID, "layer: Input should be a valid integer"),
        by_surface={"cli": error(INVALID, "layer: expected integer, got 2.5; a whole number, e.g. 2")},
    ),
    Case(
        "layer_as_boolean",
        "show_attention",
        {**SHOW, "layer": True},
        error(INVALID, "layer: Input should be a number, not a boolean"),
        by_surface={"cli": error(INVALID, "layer: expected integer, got true")},
    ),
    Case("layer_missing", "show_attention", {"text": TEXT, "head": 0}, error(INVALID, "layer: Field required")),
    Case(
        "layers_with_duplicates",
        "diagnose_collapse",
        {"text": TEXT, "layers": [2, 2]},
        error(INVALID, "layers lists duplicates [2]; give each index in 0..29 once"),
    ),
    Case(
        "heads_with_duplicates",
        "diagnose_collapse",
        {"text": TEXT, "heads": [1, 1]},
        error(INVALID, "heads lists duplicates [1]; give each index in 0..8 once"),
    ),
    Case(
        "layers_out_of_range",
        "profile_heads",
        {"text": TEXT, "layers": [0, 30]},
        error(INVALID, "30 out of range 0..29"),
    ),
    Case(
        "layers_empty",
        "diagnose_collapse",
        {"text": TEXT, "layers": []},
        error(INVALID, "give indices in 0..29 or omit it for all"),
    ),
    Case(
        "layers_not_a_list",
        "diagnose_collapse",
        {"text": TEXT, "layers": "1,2"},
        error(INVALID, "layers: Input should be a valid list"),
        by_surface={"cli": error(INVALID, 'layers: expected list of integer, got "1,2"; "1,2" -> [1, 2] (a list)')},
    ),
    Case(  # the duplicate check was quadratic (73 s); now the length is refused first, on every surface
        "layers_100k_items",
        "diagnose_collapse",
        {"text": TEXT, "layers": list(range(30)) * 3334},
        error(INVALID, "layers lists 100,020 items"),
        by_surface={
            surface: error(INVALID, "layers lists 100,020 items; at most 4,096 are accepted")
            for surface in ("mcp", "cli")
        },
    ),
    Case(
        "ablate_same_head_twice",
        "ablate_heads",
        {"text": TEXT, "heads": ["3.0", {"layer": 3, "head": 0}]},
        error(INVALID, "heads lists 3.0 more than once; give each head once"),
    ),
    Case(
        "ablate_not_a_head",
        "ablate_heads",
        {"text": TEXT, "heads": ["three"]},
        error(INVALID, "heads[0] 'three' is not a head; write each head as \"18.8\""),
    ),
    Case(
        "ablate_head_out_of_range",
        "ablate_heads",
        {"text": TEXT, "heads": ["3.9"]},
        error(INVALID, "head 9 out of range 0..8"),
    ),
    # --- other arguments ----------------------------------------------------------------------------------------
    Case(
        "unknown_argument",
        "show_attention",
        {**SHOW, "path": "/etc/passwd"},
        error(INVALID, "unknown argument 'path'"),
    ),
    Case("misspelt_argument", "describe_model", {"modle": "minilm-l6"}, error(INVALID, "unknown argument 'modle'")),
    Case(
        "top_k_zero",
        "show_attention",
        {**SHOW, "top_k": 0},
        error(INVALID, "top_k 0 out of range 1..20"),
    ),
    Case(
        "unknown_role",
        "profile_heads",
        {"text": TEXT, "roles": ["telepathy"]},
        error(INVALID, "Input should be 'previous_token'"),
    ),
    Case(
        "segment_not_in_prompt",
        "trace_prompt_attention",
        {"prompt": TEXT, "segments": [{"name": "pet", "text": "dog"}]},
        error(INVALID, "text 'dog' not found in the text (it must appear verbatim, case-sensitive)"),
    ),
    Case(
        "unknown_target",
        "trace_prompt_attention",
        {"prompt": TEXT, "target": "everything"},
        error(INVALID, "Input should be 'last' or 'generate'"),
    ),
    Case("temperature_zero", "explain_scaling", {**SHOW, "temperatures": [0]}, error(INVALID, POSITIVE)),
    Case(
        "temperature_negative",
        "explain_scaling",
        {**SHOW, "temperatures": [-0.5, 2]},
        error(INVALID, POSITIVE),
    ),
    Case("temperature_nan", "explain_scaling", {**SHOW, "temperatures": [math.nan]}, error(INVALID, FINITE)),
    Case("temperature_infinite", "explain_scaling", {**SHOW, "temperatures": [math.inf]}, error(INVALID, FINITE)),
    Case("temperature_minus_inf", "explain_scaling", {**SHOW, "temperatures": [-math.inf]}, error(INVALID, FINITE)),
    Case(
        "max_new_tokens_zero",
        "trace_prompt_attention",
        {**GENERATE, "max_new_tokens": 0},
        error(INVALID, f"max_new_tokens 0 {NEW_TOKENS}"),
    ),
    Case(
        "max_new_tokens_huge",
        "trace_prompt_attention",
        {**GENERATE, "max_new_tokens": 100_000},
        error(INVALID, f"max_new_tokens 100000 {NEW_TOKENS}"),
    ),
    Case(
        "max_new_tokens_negative",
        "compare_prompts",
        {"prompt_a": TEXT, "prompt_b": "A dog sat.", "target": "generate", "max_new_tokens": -1},
        error(INVALID, f"max_new_tokens -1 {NEW_TOKENS}"),
    ),
    Case(
        "max_new_tokens_as_word",
        "trace_prompt_attention",
        {**GENERATE, "max_new_tokens": "many"},
        error(INVALID, "max_new_tokens: Input should be a valid integer"),
        by_surface={"cli": error(INVALID, 'max_new_tokens: expected integer, got "many"')},
    ),
    Case(
        "map_over_memory_budget",
        "show_attention",
        {**SHOW, "text": NEARLY_FULL, "include_map": True},
        error(LIMIT, "this map would hold about ", f"over the budget of {MEMORY_BUDGET_MIB} MiB"),
    ),
    # --- models -------------------------------------------------------------------------------------------------
    Case("unknown_alias", "describe_model", {"model": "no-such-model"}, error(NOT_FOUND, BUNDLED)),
    Case(
        "hub_id_not_cached",
        "describe_model",
        {"model": "nobody/no-such-model"},
        error(NOT_FOUND, "is not in the local cache and the hub is offline", BUNDLED),
    ),
    Case(
        "path_not_allowed",
        "show_attention",
        {**SHOW, "model": "/etc"},
        error(REFUSED, "model '/etc' is not allowed here; allowed: ", "smollm2-135m-instruct"),
        by_surface=NOT_ALLOWED,
    ),
    Case(
        "model_name_too_long",
        "describe_model",
        {"model": "m" * 600},
        error(INVALID, "model: String should have at most 500 characters"),
        by_surface={"langchain": NOT_ALLOWED["langchain"]},
    ),
    Case(
        "missing_file",
        "show_attention",
        {**SHOW, **model("missing_gguf")},
        error(NOT_FOUND, "does not exist; give an existing model folder or .gguf file, or a bundled alias"),
    ),
    Case("truncated_gguf", "describe_model", model("truncated_gguf"), error(NOT_FOUND, "is it truncated or corrupt?")),
    Case(
        "truncated_gguf_tensors",  # header and metadata whole, tensor data cut: fails deep in the reader (~3 s)
        "describe_model",
        model("truncated_tensors_gguf"),
        error(NOT_FOUND, "is it truncated or corrupt?"),
        surfaces=("python",),
    ),
    Case(
        "gguf_with_bad_magic",
        "describe_model",
        model("bad_magic_gguf"),
        error(NOT_FOUND, "is not a GGUF file (bad magic bytes); give a valid .gguf file"),
    ),
    Case(
        "file_not_gguf",
        "describe_model",
        model("text_file"),
        error(NOT_FOUND, "is a file but not a .gguf file; give a .gguf file or a model folder"),
    ),
    Case(
        "folder_without_config",
        "describe_model",
        model("empty_folder"),
        error(NOT_FOUND, "holds no model (no config.json); give a Hugging Face model folder"),
    ),
    Case(
        "folder_with_corrupt_config",
        "describe_model",
        model("corrupt_config"),
        error(NOT_FOUND, "has an unreadable config.json", "give a Hugging Face model folder"),
    ),
    Case(
        "folder_with_unknown_model_type",
        "describe_model",
        model("unknown_model_type"),
        error(NOT_FOUND, "could not load model folder", "Give a complete model folder (config, weights, tokenizer)"),
    ),
    Case(
        "folder_needing_remote_code",
        "show_attention",
        {**SHOW, **model("remote_code")},
        error(REFUSED, "needs custom code", "remote code is never run, so it is refused"),
    ),
]
CASES = {case.id: case for case in CATALOGUE}
assert len(CASES) == len(CATALOGUE), "case ids must be unique"
REAL_CLI_CASES = ("folder_needing_remote_code", "million_characters")  # ~4.5 s each, mostly imports


# --- the bad model files ------------------------------------------------------------------------------------------
EVIL_MODULE = """
from pathlib import Path
Path(__file__).with_name("REMOTE_CODE_RAN").write_text("this file must never exist")
"""


def write_bad_models(folder: Path) -> dict[str, Path]:
    """Files and folders a ``model`` argument can point at, each wrong in its own way."""
    gguf = resolve_reference("smollm2-135m-instruct").path
    assert gguf is not None
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        name: folder / relative
        for name, relative in {
            "missing_gguf": "missing.gguf",
            "truncated_gguf": "truncated.gguf",
            "truncated_tensors_gguf": "truncated-tensors.gguf",
            "bad_magic_gguf": "bad-magic.gguf",
            "text_file": "notes.txt",
            "empty_folder": "empty",
            "corrupt_config": "corrupt-config",
            "unknown_model_type": "unknown-type",
            "remote_code": "remote-code",
        }.items()
    }
    with gguf.open("rb") as source:
        head = source.read(1 << 20)
        paths["truncated_gguf"].write_bytes(head)  # the header, cut inside the metadata
        source.seek(0)
        paths["truncated_tensors_gguf"].write_bytes(source.read(gguf.stat().st_size // 2))
    paths["bad_magic_gguf"].write_bytes(b"NOPE" + head[4:4096])
    paths["text_file"].write_text("not a model\n")
    for name in ("empty_folder", "corrupt_config", "unknown_model_type", "remote_code"):
        paths[name].mkdir()
    (paths["corrupt_config"] / "config.json").write_text('{"model_type": "llama", ')
    (paths["unknown_model_type"] / "config.json").write_text(json.dumps({"model_type": "made_up_architecture"}))
    remote = paths["remote_code"]
    (remote / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["EvilForCausalLM"],
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"},
            }
        )
    )
    (remote / "evil.py").write_text(EVIL_MODULE)
    return paths


def remote_code_ran(paths: dict[str, Path]) -> bool:
    return (paths["remote_code"] / "REMOTE_CODE_RAN").exists()


def resolve(arguments: dict[str, Any], paths: dict[str, Path]) -> dict[str, Any]:
    value = arguments.get("model")
    if isinstance(value, str) and value.startswith("@"):
        return {**arguments, "model": str(paths[value[1:]])}
    return arguments


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("catalogue")


@pytest.fixture(scope="module")
def bad_models(folder) -> dict[str, Path]:
    return write_bad_models(folder / "models")


def allowed_models(paths: dict[str, Path]) -> list[str]:
    """The allow-list every surface with one gets: the bundled models, the bad files, two unknown names."""
    return [*BUNDLED_MODELS, *(str(p) for p in paths.values()), "no-such-model", "nobody/no-such-model"]


# --- what a surface answered ----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One call through one surface: an error (kind where the surface shows it, and text) or a report."""

    error: bool
    text: str
    kind: str | None = None
    report: dict[str, Any] | None = None


ERROR_TEXT = re.compile(r"^Error \[(\w+)\]")


def from_error_text(text: str) -> Outcome:
    match = ERROR_TEXT.match(text)
    return Outcome(True, text, kind=match.group(1) if match else None)


def check(case: Case, surface: str, outcome: Outcome, paths: dict[str, Path]) -> None:
    expect = case.expected(surface)
    assert not remote_code_ran(paths), "a model folder's own code ran"
    if expect.kind is None:
        assert not outcome.error, outcome.text
        assert outcome.report is not None
        report = TOOLS[case.tool].output_model.model_validate(outcome.report)
        if case.id == "control_characters":  # the control characters reach the tokens, positions intact
            joined = "".join(token.text for token in report.tokens)  # type: ignore[attr-defined]
            assert "\x00" in joined and "\x1b" in joined
            assert [row.position for row in report.rows] == list(range(len(report.tokens)))  # type: ignore[attr-defined]
        return
    assert outcome.error, f"expected a {expect.kind} error, got a report: {outcome.text[:300]}"
    assert "Traceback" not in outcome.text and "Internal error" not in outcome.text, outcome.text
    if outcome.kind is not None or surface != "cli":  # the CLI's one line does not show the kind
        assert outcome.kind == expect.kind, outcome.text
    for fragment in expect.fragments:
        assert fragment in outcome.text, f"{fragment!r} not in {outcome.text!r}"


def case_ids(surface: str) -> list[str]:
    return [case.id for case in CATALOGUE if surface in case.surfaces]


# --- the Python API -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def python_session(bad_models, folder) -> Inspector:
    policy = ModelPolicy(frozenset(allowed_models(bad_models)))
    return Inspector(
        policy=policy,
        token_limit=TOKEN_LIMIT,
        memory_budget=MEMORY_BUDGET_MIB * 1024**2,
        artifact_dir=folder / "python-artifacts",
    )


@pytest.mark.parametrize("case_id", case_ids("python"))
def test_python_api(case_id, python_session, bad_models) -> None:
    case = CASES[case_id]
    try:
        report = TOOLS[case.tool](python_session, resolve(case.arguments, bad_models))
    except AttentionToolError as exc:
        outcome = Outcome(True, exc.message, kind=exc.kind)
    else:
        outcome = Outcome(False, report.summary, report=report.model_dump(mode="json"))
    check(case, "python", outcome, bad_models)


def test_million_characters_are_refused_before_tokenising(python_session, smol, monkeypatch) -> None:
    def tokenise(*args, **kwargs):
        raise AssertionError("a text over the character ceiling reached the tokenizer")

    monkeypatch.setattr(smol, "tokenizer", tokenise)
    for case_id in ("million_characters", "million_characters_profile"):
        case = CASES[case_id]
        with pytest.raises(AttentionToolError, match="1,000,000 characters exceeds the token limit"):
            TOOLS[case.tool](python_session, case.arguments)


# --- the LangChain toolkit ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def langchain_tools(bad_models, folder) -> dict[str, Any]:
    toolkit = AttentionToolkit(
        allowed_models=allowed_models(bad_models),
        token_limit=TOKEN_LIMIT,
        memory_budget=MEMORY_BUDGET_MIB * 1024**2,
        artifact_dir=folder / "langchain-artifacts",
    )
    return {tool.name: tool for tool in toolkit.get_tools()}


@pytest.mark.parametrize("case_id", case_ids("langchain"))
def test_langchain_toolkit(case_id, langchain_tools, bad_models) -> None:
    case = CASES[case_id]
    tool = langchain_tools[case.tool]
    arguments = resolve(case.arguments, bad_models)
    message = tool.invoke({"type": "tool_call", "id": "call_1", "name": case.tool, "args": arguments})
    assert isinstance(message, ToolMessage)
    if message.status == "error":
        assert message.artifact is None
        outcome = from_error_text(message.content)  # type: ignore[arg-type]
    else:
        outcome = Outcome(False, message.content, report=message.artifact.model_dump(mode="json"))  # type: ignore[arg-type]
    check(case, "langchain", outcome, bad_models)


# --- the MCP server -------------------------------------------------------------------------------------------------
@asynccontextmanager
async def json_lines_client(command: list[str], errlog: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The stdio transport as a client in any language writes it: one ``json.dumps`` line per message."""
    process = await anyio.open_process(command, env=ENV, cwd=ROOT, stderr=errlog)
    assert process.stdin is not None and process.stdout is not None
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def read_lines() -> None:
        buffer = ""
        async with read_writer:
            async for chunk in TextReceiveStream(process.stdout):  # type: ignore[arg-type]
                *lines, buffer = (buffer + chunk).split("\n")
                for line in lines:
                    if line.strip():
                        await read_writer.send(SessionMessage(types.jsonrpc_message_adapter.validate_json(line)))

    async def write_lines() -> None:
        async with write_reader:
            async for message in write_reader:
                data = message.message.model_dump(by_alias=True, mode="json", exclude_none=True)
                await process.stdin.send((json.dumps(data) + "\n").encode())  # type: ignore[union-attr]

    async with process, anyio.create_task_group() as group:
        group.start_soon(read_lines)
        group.start_soon(write_lines)
        try:
            yield read_stream, write_stream
        finally:
            await process.stdin.aclose()
            with anyio.move_on_after(30):
                await process.wait()
            if process.returncode is None:
                process.terminate()
            group.cancel_scope.cancel()


# Eight calls on the default model, two of them failing: concurrent requests must give the sequential results.
CONCURRENT_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("show_attention", SHOW),
    ("ablate_heads", {"text": TEXT, "heads": ["3.0", "5.2"]}),
    ("diagnose_collapse", {"text": TEXT, "layers": [0, 3, 7], "top_k": 3}),
    ("explain_scaling", {**SHOW, "synthetic": False}),
    ("attention_rollout", {"text": TEXT}),
    ("show_attention", {**SHOW, "layer": 99}),
    ("reconstruct_attention", SHOW),
    ("diagnose_collapse", {"text": " ", "layers": [0]}),
]


@dataclass
class McpTranscript:
    catalogue: dict[str, Outcome]
    sequential: list[dict[str, Any]]
    concurrent: list[dict[str, Any]]
    after_burst: dict[str, Any]
    log: str = ""


def mcp_outcome(result: types.CallToolResult) -> Outcome:
    text = "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
    if result.is_error:
        return from_error_text(text)
    return Outcome(False, text, report=result.structured_content)


def comparable(result: types.CallToolResult) -> dict[str, Any]:
    return {
        "isError": result.is_error,
        "structured": result.structured_content,
        "content": result.model_dump()["content"],
    }


async def drive(command: list[str], log_path: Path, paths: dict[str, Path]) -> McpTranscript:
    outcomes: dict[str, Outcome] = {}
    with log_path.open("w") as errlog:
        async with json_lines_client(command, errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()

            async def call(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
                with anyio.fail_after(CALL_TIMEOUT_S):  # no answer in time = a hang
                    return await session.call_tool(name, arguments)

            for case in CATALOGUE:
                if "mcp" in case.surfaces:
                    outcomes[case.id] = mcp_outcome(await call(case.tool, resolve(case.arguments, paths)))
            sequential = [comparable(await call(name, args)) for name, args in CONCURRENT_CALLS]
            concurrent: list[dict[str, Any] | None] = [None] * len(CONCURRENT_CALLS)

            async def one(index: int) -> None:
                name, args = CONCURRENT_CALLS[index]
                concurrent[index] = comparable(await call(name, args))

            async with anyio.create_task_group() as group:
                for index in range(len(CONCURRENT_CALLS)):
                    group.start_soon(one, index)
            after = comparable(await call(*CONCURRENT_CALLS[1]))  # the logits-based report, once more
    return McpTranscript(outcomes, sequential, concurrent, after, log_path.read_text())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mcp_transcript(folder, bad_models) -> McpTranscript:
    options = [option for path in allowed_models(bad_models) for option in ("--allow-model", path)]
    options += ["--token-limit", str(TOKEN_LIMIT), "--memory-budget", str(MEMORY_BUDGET_MIB)]
    command = server_command(*options, artifacts=folder / "mcp-artifacts")
    return anyio.run(drive, command, folder / "mcp-server.log", bad_models)


@pytest.mark.parametrize("case_id", case_ids("mcp"))
def test_mcp_server(case_id, mcp_transcript, bad_models) -> None:
    check(CASES[case_id], "mcp", mcp_transcript.catalogue[case_id], bad_models)


def test_mcp_concurrent_requests_equal_sequential(mcp_transcript) -> None:
    assert mcp_transcript.concurrent == mcp_transcript.sequential
    failed = [result["isError"] for result in mcp_transcript.sequential]
    assert failed.count(True) == 2 and failed[5] and failed[7]
    assert mcp_transcript.after_burst == mcp_transcript.sequential[1]  # same logits after the burst
    assert mcp_transcript.sequential[1]["structured"]["kl_last_position"] > 0


def test_mcp_lone_surrogates_are_answered_not_dropped(mcp_transcript) -> None:
    """The SDK cannot parse a line holding ``"\\udfff"`` and would never answer it; the server names the argument."""
    outcome = mcp_transcript.catalogue["lone_surrogate_in_message"]
    assert "(argument 'prompt[0].content')" in outcome.text and NOT_UNICODE in outcome.text


def test_mcp_server_log_has_no_traceback(mcp_transcript) -> None:
    assert "Traceback" not in mcp_transcript.log
    assert "Internal Server Error" not in mcp_transcript.log and "Received exception" not in mcp_transcript.log
    assert f"token limit: {TOKEN_LIMIT}; memory budget: {MEMORY_BUDGET_MIB} MiB" in mcp_transcript.log


# --- the CLI ----------------------------------------------------------------------------------------------------------
def cli_arguments(folder: Path, case: Case) -> list[str]:
    return [
        "--artifacts",
        str(folder / "cli-artifacts"),
        "--token-limit",
        str(TOKEN_LIMIT),
        "--memory-budget",
        str(MEMORY_BUDGET_MIB),
        "call",
        case.tool,
        "--json",
    ]


def cli_outcome(code: int, stdout: str, stderr: str) -> Outcome:
    assert "Traceback" not in stderr, stderr
    if code == 0:
        return Outcome(False, stdout, report=json.loads(stdout))
    assert code == 2, (code, stderr)
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr  # one line, the last: the whole message
    return Outcome(True, errors[0])


@pytest.mark.parametrize("case_id", case_ids("cli"))
def test_cli_in_process(case_id, folder, bad_models, capsys) -> None:
    case = CASES[case_id]
    argv = [*cli_arguments(folder, case), json.dumps(resolve(case.arguments, bad_models))]
    code = cli.main(argv)
    captured = capsys.readouterr()
    check(case, "cli", cli_outcome(code, captured.out, captured.err), bad_models)


@pytest.mark.parametrize("case_id", REAL_CLI_CASES)
def test_cli_subprocess(case_id, folder, bad_models) -> None:
    case = CASES[case_id]
    argv = [sys.executable, "-m", "agent_tools.cli", *cli_arguments(folder, case), "-"]
    result = subprocess.run(
        argv,
        input=json.dumps(resolve(case.arguments, bad_models)),
        capture_output=True,
        text=True,
        env={**ENV, "PYTHONWARNINGS": "ignore"},
        cwd=ROOT,
        timeout=300,
    )
    check(case, "cli", cli_outcome(result.returncode, result.stdout, result.stderr), bad_models)


def test_no_model_folder_code_ever_ran(bad_models, mcp_transcript) -> None:
    assert sorted(os.listdir(bad_models["remote_code"])) == ["config.json", "evil.py"]
