"""The LangChain surface: every declared tool as a StructuredTool, and the agent loop with create_agent.

The agent tests use a scripted chat model that reads the tool messages it receives (content, status,
artifact) and decides its next step from them, offline.
"""

from __future__ import annotations

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from pydantic import ValidationError
from scripted_chat import (
    ScriptedChatModel,
    all_tool_messages,
    answer,
    ask,
    call,
    key_numbers,
    new_tool_messages,
    valid_range,
)

from agent_tools.inspector import Inspector
from agent_tools.loading import BUNDLED_MODELS, DEFAULT_MODEL, ModelPolicy
from agent_tools.schemas import Report
from agent_tools.surfaces import CONTENT_LIMIT, agent_input_model
from agent_tools.surfaces.langchain import AttentionToolkit, make_tool
from agent_tools.tools import TOOLS, get_tool
from agent_tools.tools.registry import ToolSpec

pytestmark = pytest.mark.xdist_group("example_runs")  # one worker with test_budgets.py: the runs are made once

SHOW = get_tool("show_attention")
DESCRIBE = get_tool("describe_model")


def invoke(tool, args: dict, call_id: str = "call_1") -> ToolMessage:
    return tool.invoke({"type": "tool_call", "id": call_id, "name": tool.name, "args": args})


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory) -> AttentionToolkit:
    return AttentionToolkit(artifact_dir=tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="module")
def tools(toolkit) -> dict:
    return {tool.name: tool for tool in toolkit.get_tools()}


@pytest.fixture(scope="module")
def replayed(toolkit, example_runs) -> dict:
    """Every tool as ``get_tools`` makes it, its analysis of the example replayed from the session's run of it
    (``example_runs``: test_budgets.py measures the same runs); arguments, checking and cutting are the call's."""
    return {name: make_tool(example_runs.replaying(spec), toolkit.session) for name, spec in TOOLS.items()}


# --- the toolkit -------------------------------------------------------------------------------------------
def test_toolkit_offers_every_declared_tool(tools) -> None:
    assert list(tools) == list(TOOLS)
    for name, tool in tools.items():
        spec = TOOLS[name]
        assert tool.description == spec.description
        assert tool.response_format == "content_and_artifact"
        schema = tool.tool_call_schema.model_json_schema()
        advertised = agent_input_model(spec, ModelPolicy.bundled_only()).model_json_schema()["properties"]
        assert set(schema["properties"]) == set(advertised) <= set(spec.input_model.model_fields)
        if "model" in schema["properties"]:  # the allow-list is visible to the agent
            assert sorted(schema["properties"]["model"]["anyOf"][0]["enum"]) == sorted(BUNDLED_MODELS)


def test_toolkit_selection_is_validated() -> None:
    chosen = AttentionToolkit(tools=["show_attention", "describe_model"]).get_tools()
    assert [t.name for t in chosen] == ["describe_model", "show_attention"]  # declaration order
    with pytest.raises(ValidationError, match=r"unknown tool.*'no_such_tool'.*tools: describe_model"):
        AttentionToolkit(tools=["no_such_tool"])
    with pytest.raises(ValidationError, match="empty"):
        AttentionToolkit(tools=[])


def test_toolkit_policy() -> None:
    default = AttentionToolkit()
    assert default.model == DEFAULT_MODEL
    assert default.session.policy.allowed == frozenset(BUNDLED_MODELS)
    custom = AttentionToolkit(model="minilm-l6", allowed_models=["minilm-l6"])
    assert custom.session.policy.allowed == frozenset({"minilm-l6"}) and custom.session.policy.default == "minilm-l6"
    shared = Inspector(policy=ModelPolicy.bundled_only())
    assert AttentionToolkit(inspector=shared).session is shared


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(TOOLS))
def test_every_tool_answers_with_content_and_artifact(replayed, name) -> None:
    spec = TOOLS[name]
    message = invoke(replayed[name], dict(spec.example))
    assert message.status == "success", message.content
    report = message.artifact
    assert isinstance(report, spec.output_model) and isinstance(report, Report)
    assert message.content.startswith(report.summary)  # concise: the summary first, then findings and numbers
    assert len(message.content.encode()) <= CONTENT_LIMIT  # the 2 KB budget
    assert message.name == name and message.tool_call_id == "call_1"


# --- expected failures come back as error tool messages -------------------------------------------------
@pytest.mark.real_model
def test_out_of_range_layer_is_an_error_message_naming_the_range(tools) -> None:
    message = invoke(tools["show_attention"], {**SHOW.example, "layer": 99})
    assert message.status == "error"
    assert "layer 99 out of range 0..29" in message.content
    assert message.artifact is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"top_k": 0}, "top_k 0 out of range 1..20"),
        ({"layer": "three"}, "layer: Input should be a valid integer"),
        ({"surprise": 1}, "unknown argument 'surprise'"),
        ({"model": "/etc/passwd"}, "Input should be 'minilm-l6' or 'smollm2-135m-instruct'"),
    ],
)
def test_validation_errors_keep_their_detail(tools, args, expected) -> None:
    message = invoke(tools["show_attention"], {**SHOW.example, **args})
    assert message.status == "error"
    assert expected in message.content
    assert "Tool input validation error" not in message.content


@pytest.mark.parametrize(
    ("heads", "expected"),
    [([[3]], "heads[0] [3] is not a head"), ([3, 0], "[[3, 0]]"), ("nonsense", "'nonsense' is not a head")],
)
def test_a_wrong_head_form_names_the_accepted_forms(tools, heads, expected) -> None:
    message = invoke(tools["ablate_heads"], {"text": "The cat sat.", "heads": heads})
    assert message.status == "error" and expected in message.content
    assert (
        '"18.8"' in message.content and "[18, 8]" in message.content and '{"layer": 18, "head": 8}' in message.content
    )
    assert "HeadRef" not in message.content and "valid string" not in message.content  # not pydantic's union dump


def test_missing_argument_and_empty_text(tools) -> None:
    message = invoke(tools["show_attention"], {"text": "hi", "layer": 0})
    assert message.status == "error" and "head: Field required" in message.content
    message = invoke(tools["show_attention"], {**SHOW.example, "text": "   "})
    assert message.status == "error" and "empty" in message.content


def test_refused_model_when_the_allow_list_is_explicit() -> None:
    tool = AttentionToolkit(tools=["describe_model"], allowed_models=["minilm-l6"], model="minilm-l6").get_tools()[0]
    message = invoke(tool, {"model": "smollm2-135m-instruct"})
    assert message.status == "error" and "Input should be 'minilm-l6'" in message.content


def _failing_spec() -> ToolSpec:
    def broken(inspector, args):
        raise RuntimeError("a bug, not a user error")

    return ToolSpec("describe_model", "broken", DESCRIBE.input_model, DESCRIBE.output_model, broken, {})


def test_bugs_still_raise() -> None:
    tool = make_tool(_failing_spec(), Inspector(policy=ModelPolicy.bundled_only()))
    with pytest.raises(RuntimeError, match="a bug"):
        invoke(tool, {})


def test_an_invalid_report_is_a_bug_not_a_validation_message() -> None:
    def wrong_report(inspector, args):
        return {"model": "x"}  # not a valid report: the output model refuses it

    spec = ToolSpec("describe_model", "", DESCRIBE.input_model, DESCRIBE.output_model, wrong_report, {})
    tool = make_tool(spec, Inspector(policy=ModelPolicy.bundled_only()))
    with pytest.raises(RuntimeError, match="a bug, not the caller's input"):
        invoke(tool, {})


def test_bugs_raise_through_the_agent() -> None:
    tool = make_tool(_failing_spec(), Inspector(policy=ModelPolicy.bundled_only()))
    model = ScriptedChatModel(policy=lambda messages, _: ask(call("describe_model")))
    agent = create_agent(model, [tool])
    with pytest.raises(RuntimeError, match="a bug"):
        agent.invoke({"messages": [("user", "describe it")]})


# --- the agent loop --------------------------------------------------------------------------------------
def final_answer(result: dict) -> str:
    last = result["messages"][-1]
    assert isinstance(last, AIMessage) and not last.tool_calls
    return last.content


@pytest.mark.real_model
def test_agent_correct_call_numbers_reach_the_final_answer(toolkit) -> None:
    def policy(messages, bound):
        assert "show_attention" in {t["function"]["name"] for t in bound}
        received = new_tool_messages(messages)
        if not received:
            return ask(call("show_attention", **SHOW.example))
        (message,) = received
        if message.status != "success":
            return answer(f"the tool failed: {message.content}")
        numbers = key_numbers(message.content)  # what an LLM reads
        report = message.artifact  # what the application keeps
        assert float(numbers["mean_entropy"]) == report.mean_entropy
        top = report.findings[0]
        return answer(
            f"Layer {numbers['layer']}, head {numbers['head']}: mean entropy {numbers['mean_entropy']} nats; "
            f"it reads token {top.position} {top.token!r} most ({top.value:.1%})."
        )

    model = ScriptedChatModel(policy=policy)
    agent = create_agent(model, toolkit.get_tools(), system_prompt="You explain attention.")
    text = final_answer(agent.invoke({"messages": [("user", "What does layer 3 head 0 read?")]}))
    expected = SHOW(toolkit.session, SHOW.example)  # the same call, made directly
    assert f"mean entropy {expected.mean_entropy} nats" in text
    assert f"token {expected.findings[0].position} {expected.findings[0].token!r}" in text
    assert f"({expected.findings[0].value:.1%})" in text
    assert len(model.turns) == 2


@pytest.mark.real_model
def test_agent_corrects_a_bad_layer_from_the_error_message(toolkit) -> None:
    def policy(messages, bound):
        received = new_tool_messages(messages)
        if not received:
            return ask(call("show_attention", **{**SHOW.example, "layer": 99}))
        (message,) = received
        if message.status == "error":
            _low, high = valid_range(message.content, "layer")  # decided from the message, not known beforehand
            return ask(call("show_attention", **{**SHOW.example, "layer": high}))
        return answer(f"Layer {message.artifact.layer}: mean entropy {key_numbers(message.content)['mean_entropy']}")

    model = ScriptedChatModel(policy=policy)
    agent = create_agent(model, toolkit.get_tools())
    result = agent.invoke({"messages": [("user", "Look at layer 99 head 0.")]})
    first, second = all_tool_messages(result["messages"])
    assert first.status == "error" and "out of range 0..29" in first.content and first.artifact is None
    assert second.status == "success" and second.artifact.layer == 29
    assert final_answer(result) == f"Layer 29: mean entropy {second.artifact.mean_entropy}"


@pytest.mark.real_model
def test_agent_two_tools_in_parallel(toolkit) -> None:
    def policy(messages, bound):
        received = new_tool_messages(messages)
        if not received:
            return ask(call("describe_model"), call("show_attention", **SHOW.example))
        by_name = {m.name: m for m in received}
        assert set(by_name) == {"describe_model", "show_attention"}
        assert all(m.status == "success" for m in received)
        described = key_numbers(by_name["describe_model"].content)
        shown = key_numbers(by_name["show_attention"].content)
        return answer(
            f"{by_name['describe_model'].artifact.model} has {described['num_layers']} layers of "
            f"{described['num_heads']} heads; layer {shown['layer']} head {shown['head']} has mean entropy "
            f"{shown['mean_entropy']} nats."
        )

    model = ScriptedChatModel(policy=policy)
    agent = create_agent(model, toolkit.get_tools())
    result = agent.invoke({"messages": [("user", "Describe the model and show layer 3 head 0.")]})
    calls = [m for m in result["messages"] if isinstance(m, AIMessage) and m.tool_calls]
    assert len(calls) == 1 and len(calls[0].tool_calls) == 2  # both requested in one turn
    answered = {m.tool_call_id for m in all_tool_messages(result["messages"])}
    assert answered == {c["id"] for c in calls[0].tool_calls}
    shown = SHOW(toolkit.session, SHOW.example)
    assert final_answer(result) == (
        f"smollm2-135m-instruct has 30 layers of 9 heads; layer 3 head 0 has mean entropy {shown.mean_entropy} nats."
    )


@pytest.mark.real_model
def test_agent_async(toolkit) -> None:
    import anyio

    def policy(messages, bound):
        received = new_tool_messages(messages)
        if not received:
            return ask(call("describe_model", model="minilm-l6"))
        return answer(f"{key_numbers(received[0].content)['num_layers']} layers")

    agent = create_agent(ScriptedChatModel(policy=policy), toolkit.get_tools())

    async def run() -> dict:
        return await agent.ainvoke({"messages": [("user", "How many layers has MiniLM?")]})

    assert final_answer(anyio.run(run)) == "6 layers"


# --- OpenAI strict function calling through LangChain -----------------------------------------------------------
def test_strict_toolkit_schemas_are_strict_for_bind_tools() -> None:
    import copy

    from langchain_core.utils.function_calling import convert_to_openai_tool
    from openai.lib._pydantic import _ensure_strict_json_schema

    for tool in AttentionToolkit(strict=True).get_tools():
        function = convert_to_openai_tool(tool, strict=True)["function"]
        parameters = function["parameters"]
        converted = copy.deepcopy(parameters)
        assert _ensure_strict_json_schema(converted, path=(), root=converted) == parameters, tool.name
        assert function["strict"] is True and parameters["required"] == list(parameters["properties"])


def test_strict_tool_reads_null_as_not_given(tiny_models) -> None:
    text = "the cat sat on the mat because it was tired . the dog sat on the mat"
    kit = {"model": "tiny-llama", "allowed_models": ["tiny-llama"], "tools": ["diagnose_collapse"]}
    (strict,) = AttentionToolkit(strict=True, **kit).get_tools()
    (plain,) = AttentionToolkit(**kit).get_tools()
    sent = {key: None for key in strict.args_schema["properties"]} | {"text": text}
    answered = invoke(strict, sent)
    assert answered.status == "success", answered.content
    expected = invoke(plain, {"text": text})
    assert answered.artifact == expected.artifact and answered.content == expected.content
    refused = invoke(plain, sent)  # the plain schema takes no null for a number
    assert refused.status == "error"
