"""Agent-sized answers (issue 18): every tool's answer to its example on the default model fits the budgets,
says what detail 'summary' left out, never drops what its summary counts, and names runnable next calls.

The unit tests of the cutting (``Top``, ``trim``) and of the concise text's budget run on constructed reports.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import ModelPolicy, load_model
from agent_tools.schemas import DETAILS, Finding, NextCall, Report
from agent_tools.session import HANDLE_AFTER_CHARS, TextStore
from agent_tools.settings import DEFAULT_MEMORY_BUDGET
from agent_tools.surfaces import CONTENT_LIMIT, agent_input_model, agent_input_schema, clip_words, concise_text
from agent_tools.surfaces.openai import openai_tools
from agent_tools.tools import TOOLS
from agent_tools.tools.registry import Top, trim

pytestmark = pytest.mark.xdist_group("example_runs")  # one worker with test_langchain.py: the runs are made once

TEXT_BUDGET = 2 * 1024
REPORT_BUDGET = 16 * 1024
# Issue 28's target for descriptions + input schemas, all tools together, met with 18 tools: 10,198 B (13,758 B
# before the shared arguments' forms — chat messages, heads, segments, the choices of detail, model, target,
# checks, attention — were written once, in the prompts' "Arguments" block, and shown as their JSON types alone:
# tool_declarations.shared_forms; tests/test_prompts.py holds the block to every form, test_portable_schemas.py
# the shown schemas to every form the tools accept).
DECLARATIONS_BUDGET = 10 * 1024
TOOLS_LIST_TARGET = 32 * 1024  # issue 28's target for MCP tools/list with output schemas
TOOLS_LIST_BUDGET = 32_000  # issue 28's target, met with 18 tools (22,587 B: output schemas 9.5 KB, no titles)


def size(value: Any) -> int:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode())


# --- cutting, on constructed reports -------------------------------------------------------------------------


class Row(BaseModel):
    name: str
    score: float | None
    points: list[int] = Field(default_factory=list)


class Table(Report):
    rows: list[Row]
    series: list[int] = Field(default_factory=list)


def table() -> Table:
    rows = [
        Row(name="a", score=0.1, points=[1, 2, 3]),
        Row(name="b", score=-0.9, points=[4]),
        Row(name="c", score=None),
        Row(name="d", score=0.5, points=[5, 6, 7, 8]),
        Row(name="e", score=-0.2),
    ]
    return Table(model="m", summary="s", rows=rows, series=list(range(10)))


def test_top_keeps_the_most_important_rows_first_and_says_what_it_left_out() -> None:
    report = table()
    omitted = trim(report, [Top("rows", 2, by="score", order="largest_abs")])
    assert [r.name for r in report.rows] == ["b", "d"]  # |−0.9| > 0.5 > |−0.2| > 0.1; None last
    assert [o.model_dump() for o in omitted] == [
        {"field": "rows", "kept": 2, "total": 5, "order": "by |score|, largest first", "cutoff": -0.2}
    ]
    report = table()
    trim(report, [Top("rows", 3, by="score", order="smallest")])
    assert [r.name for r in report.rows] == ["b", "e", "a"]
    report = table()
    assert trim(report, [Top("rows", 3, by="score")])[0].cutoff == -0.9  # left out: b (−0.9) and c (None)
    assert [r.name for r in report.rows] == ["d", "a", "e"]


def test_nested_paths_series_and_lists_under_the_limit() -> None:
    report = table()
    omitted = trim(report, [Top("rows[].points", 2, order="first"), Top("series", 4, order="spaced")])
    assert [r.points for r in report.rows] == [[1, 2], [4], [], [5, 6], []]
    assert report.series == [0, 3, 6, 9]  # evenly spaced, first and last kept
    assert [(o.field, o.kept, o.total, o.cutoff) for o in omitted] == [
        ("rows[].points", 5, 8, None),
        ("series", 4, 10, None),
    ]
    untouched = table()
    assert trim(untouched, [Top("rows", 5, by="score")]) == [] and untouched == table()


# --- the concise text, on constructed reports ------------------------------------------------------------------


def long_report() -> Report:
    findings = [Finding(kind="low", severity="low", detail=f"low finding {i} " + "context " * 30) for i in range(6)]
    findings += [
        Finding(kind="bad", severity="high", detail=f"harmful head L{i}H{i} " + "evidence " * 20) for i in (7, 8)
    ]
    findings += [Finding(kind="mid", severity="medium", detail="a medium finding " + "words " * 25)]
    calls = [NextCall(tool="ablate_heads", arguments={"text": "x " * 200, "heads": ["7.7"]}, why="does it matter")]
    return Report(
        model="m", summary="Two heads collapse harmfully. " + "Detail " * 40, findings=findings, next_calls=calls
    )


def test_concise_text_keeps_the_most_important_lines_within_the_budget() -> None:
    report = long_report()
    text = concise_text(report)
    assert size(text) <= CONTENT_LIMIT <= TEXT_BUDGET
    lines = text.split("\n")
    assert lines[0] == report.summary
    assert lines[1].startswith("- harmful head L7H7") and lines[2].startswith("- harmful head L8H8")
    assert "- a medium finding" in text and 'next: ablate_heads {"text": "x x' in text
    shown = [f for f in report.findings if f"- {f.detail}" in lines]
    assert len(shown) < len(report.findings) and all(f.severity == "low" for f in report.findings if f not in shown)
    assert all(line == report.summary or line.startswith(("- ", "next: ")) for line in lines)  # whole lines only
    assert concise_text(report, limit=400).split("\n") == [clip_words(report.summary, 400)]


def test_clip_words_never_cuts_inside_a_word() -> None:
    assert clip_words("short", 10) == "short"
    assert clip_words("alpha beta gamma delta", 16) == "alpha beta…"
    assert clip_words("One sentence here. Another one follows on.", 30) == "One sentence here. …"


# --- every tool on the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def answers(example_runs) -> dict[str, tuple[Report, Report]]:
    """Each tool's example, run once (``example_runs``, shared with the LangChain surface's test) and checked with
    detail 'full' as a call would check it; its summary is the same report cut as a call would cut it
    (``ToolSpec.check`` with the example's arguments, whose detail defaults to 'summary')."""
    inspector = example_runs.inspector
    out = {}
    for name, spec in TOOLS.items():
        full = spec.check(example_runs.run(name), inspector, arguments=example_runs.arguments(name, "full"))
        summary = spec.check(full.model_copy(deep=True), inspector, arguments=spec.parse(spec.example))
        out[name] = (summary, full)
    return out


@pytest.mark.real_model
def test_a_call_cuts_as_check_does(answers, tmp_path) -> None:
    spec = TOOLS["diagnose_collapse"]
    called = spec(Inspector(artifact_dir=tmp_path), {**spec.example, "top_k": 30})
    assert len(called.heads) == 10 and called.omitted[0].total == 30 and called.omitted[0].kept == 10
    first = [(h.layer, h.head) for h in answers["diagnose_collapse"][1].heads]  # the example lists 5
    assert [(h.layer, h.head) for h in called.heads][:5] == first


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(TOOLS))
def test_answers_fit_their_budgets(answers, name: str) -> None:
    summary, full = answers[name]
    assert size(concise_text(summary)) <= TEXT_BUDGET
    assert size(summary.model_dump(mode="json")) <= REPORT_BUDGET
    assert full.omitted == [] and size(full.model_dump(mode="json")) >= size(summary.model_dump(mode="json"))
    for cut in summary.omitted:  # the counts are the full report's
        rule = next(r for r in TOOLS[name].summary_lists if r.field == cut.field)
        assert cut.total == _rows(full, cut.field) > cut.kept == _rows(summary, cut.field)
        assert cut.kept <= rule.limit * max(1, _owners(summary, cut.field))


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(TOOLS))
def test_cut_lists_are_ranked_most_important_first(answers, name: str) -> None:
    summary, _ = answers[name]
    for cut in summary.omitted:
        rule = next(r for r in TOOLS[name].summary_lists if r.field == cut.field)
        if rule.order in ("first", "spaced"):
            continue
        for rows in _lists(summary, cut.field):
            ranks = [abs(v) if rule.order == "largest_abs" else v for v in (rule.key(r) for r in rows) if v is not None]
            assert ranks == sorted(ranks, reverse=rule.order != "smallest")
            if cut.cutoff is not None and ranks and _owners(summary, cut.field) == 1:  # one list: one cutoff
                cutoff = abs(cut.cutoff) if rule.order == "largest_abs" else cut.cutoff
                assert cutoff >= ranks[-1] - 1e-9 if rule.order == "smallest" else cutoff <= ranks[-1] + 1e-9


@pytest.mark.real_model
def test_profile_heads_cuts_the_head_table_by_confidence(answers) -> None:
    summary, full = answers["profile_heads"]
    assert len(full.heads) == 27 and len(summary.heads) == 12
    confidences = sorted((h.confidence for h in full.heads), reverse=True)
    assert [h.confidence for h in summary.heads] == confidences[:12]
    assert summary.omitted[0].cutoff == confidences[12]


@pytest.mark.real_model
def test_the_concise_text_says_what_removing_the_collapsed_heads_did(answers) -> None:
    summary, _ = answers["diagnose_collapse"]
    text = concise_text(summary)
    check = summary.check
    assert check is not None and check.checked >= 1 and check.baseline is not None
    kinds = [
        f for f in summary.findings if f.kind in ("harmful", "load_bearing", "mixed", "constant_output", "no_op_sink")
    ]
    assert len(kinds) == check.checked  # one finding per checked head, with the kind measured
    lines = text.split("\n")
    assert f"{check.baseline.draws} random heads" in lines[0]  # the baseline is in the summary itself
    harmful = [c for c in check.heads if c.kind == "harmful"]
    assert ("None is harmful" in lines[0]) == (not harmful)
    for row in check.heads[:3]:
        assert any(f"L{row.layer}H{row.head} is " in line for line in lines)
    moved = [c for c in check.heads if c.kind in ("harmful", "load_bearing", "mixed")]
    first = moved[0] if moved else next(h for h in summary.heads if h.verdict != "not_collapsed")
    assert f'next: ablate_heads {{"text": "{summary_text(summary)}", "heads": ["{first.layer}.{first.head}"' in text


def summary_text(report: Report) -> str:
    return TOOLS["diagnose_collapse"].example["text"]


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(TOOLS))
def test_every_summary_sentence_and_high_finding_reaches_the_text(answers, name: str) -> None:
    summary, _ = answers[name]
    text = concise_text(summary)
    assert text.split("\n")[0] == summary.summary  # whole: scaling_experiment's no longer stops at "accuracy …"
    assert all(f"- {f.detail}" in text for f in summary.findings if f.severity == "high")


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(TOOLS))
def test_next_calls_are_runnable_and_shown(answers, name: str) -> None:
    summary, full = answers[name]
    assert summary.next_calls == full.next_calls and len(summary.next_calls) <= 3
    if name != "corpus_summary":  # no data is allowed in the test session: nothing to follow up
        assert summary.next_calls
    text = concise_text(summary)
    for call in summary.next_calls:
        TOOLS[call.tool].parse(call.arguments)  # valid as written, for the tool it names
        assert f"next: {call.tool} " in text


@pytest.mark.real_model
def test_next_calls_draw_on_the_results(answers) -> None:
    collapse, _ = answers["diagnose_collapse"]
    assert collapse.check is not None
    moved = [f"{c.layer}.{c.head}" for c in collapse.check.heads if c.kind in ("harmful", "load_bearing", "mixed")]
    most = next(f"{h.layer}.{h.head}" for h in collapse.heads if h.verdict != "not_collapsed")
    expected = moved[:4] or [most]  # the heads whose removal moved the loss, else the most collapsed one
    assert collapse.next_calls[0].tool == "ablate_heads" and collapse.next_calls[0].arguments["heads"] == expected
    shown, _ = answers["show_attention"]
    assert shown.next_calls[1].arguments == {"text": TOOLS["show_attention"].example["text"], "layers": [shown.layer]}
    scaling, _ = answers["explain_scaling"]
    widest = max(scaling.head_variances, key=lambda r: r.raw_variance)
    assert scaling.next_calls[0].arguments["head"] == widest.head


# --- declarations --------------------------------------------------------------------------------------------


def test_every_tool_takes_detail() -> None:
    policy = ModelPolicy.bundled_only()
    for spec in TOOLS.values():
        schema = agent_input_model(spec, policy).model_json_schema()
        assert (
            schema["properties"]["detail"]["enum"] == list(DETAILS) and spec.parse({**spec.example}).detail == "summary"
        )
        with pytest.raises(InvalidInputError, match="detail"):
            spec.parse({**spec.example, "detail": "everything"})


def test_advanced_arguments_are_accepted_but_not_advertised() -> None:
    policy = ModelPolicy.bundled_only()
    for spec in TOOLS.values():
        properties = agent_input_model(spec, policy).model_json_schema()["properties"]
        assert not set(spec.advanced) & set(properties)
        assert "attention" not in properties  # the bundled models have one attention stack
    trace = TOOLS["trace_prompt_attention"]
    assert trace.parse({"prompt": "hi", "ig_steps": 8}).ig_steps == 8
    advertised = agent_input_schema(trace, policy)
    jsonschema.validate({"prompt": "hi", "ig_steps": 8}, advertised)  # the schema does not refuse what it hides
    with pytest.raises(ValidationError, match="max_new_tokens"):  # still validated as declared
        agent_input_model(trace, policy).model_validate({"prompt": "hi", "max_new_tokens": 10_000})


def test_descriptions_and_input_schemas_are_small() -> None:
    declared = sum(size(t["function"]["description"]) + size(t["function"]["parameters"]) for t in openai_tools())
    assert declared <= DECLARATIONS_BUDGET, f"{declared} bytes (budget {DECLARATIONS_BUDGET})"
    for spec in TOOLS.values():  # concise, and each says when to use it
        assert size(spec.description) <= 240 and re.search(r"\b(Use|Call|Omit)\b", spec.description), spec.name


# --- helpers ---------------------------------------------------------------------------------------------------


def _lists(report: BaseModel, path: str) -> list[list[Any]]:
    """Every list the path names in the report (``a[].b``: one per row of a)."""
    head, _, rest = path.partition(".")
    value = getattr(report, head.removesuffix("[]"), None)
    if not rest:
        return [value] if isinstance(value, list) else []
    items = value if head.endswith("[]") and isinstance(value, list) else [value]
    return [found for item in items if item is not None for found in _lists(item, rest)]


def _rows(report: BaseModel, path: str) -> int:
    return sum(len(rows) for rows in _lists(report, path))


def _owners(report: BaseModel, path: str) -> int:
    return len(_lists(report, path))


def test_tools_list_is_small() -> None:
    from agent_tools.mcp_front import tool_listing

    listed = tool_listing(TOOLS, ModelPolicy.bundled_only())["tools"]
    assert size({"tools": listed}) <= TOOLS_LIST_BUDGET, f"{size({'tools': listed})} bytes (target {TOOLS_LIST_TARGET})"


# --- text handles: next calls name a long text, the tools accept the name --------------------------------------


def test_text_handles_replace_long_strings_and_resolve_back(tmp_path) -> None:
    long, short = "word " * 100, "x" * HANDLE_AFTER_CHARS
    store = TextStore()
    referred = store.refer({"text": long, "prompt": [{"role": "user", "content": long}], "short": short, "n": 3})
    handle = referred["text"]
    assert handle.startswith("@text:") and len(handle) == 22 and referred["prompt"][0]["content"] == handle
    assert referred["short"] == short and referred["n"] == 3  # short strings and numbers stay as they are
    assert store.resolve(referred) == {
        "text": long,
        "prompt": [{"role": "user", "content": long}],
        "short": short,
        "n": 3,
    }
    plain = {"text": "hi"}
    assert store.resolve(plain) is plain  # nothing to resolve: the same object
    with pytest.raises(InvalidInputError, match="names no text this session has seen"):
        TextStore().resolve({"text": handle})
    kept = TextStore(tmp_path)  # a folder: the next process's store reads the text
    assert TextStore(tmp_path).resolve({"text": kept.handle(long)}) == {"text": long}
    with pytest.raises(InvalidInputError, match="names no text"):
        TextStore(tmp_path).resolve({"text": "@text:../../etc/passwd"})  # only 16 hex digits name a text


def _tiny_arguments(
    name: str, text: str, *, model: str = "tiny-llama", other: str | None = None, pieces: tuple[str, str] | None = None
) -> dict[str, Any]:
    """The tool's example on ``model`` (the tiny llama): text fields swapped for ``text`` (the second prompt of a
    pair: ``other``, else ``text`` with cat for dog; position_sensitivity moves ``pieces`` of it), indices clipped."""
    arguments: dict[str, Any] = {**TOOLS[name].example, "model": model}
    for key in list(arguments):
        if key in {"text", "prompt", "prompt_a", "clean"}:
            arguments[key] = text
        elif key in {"prompt_b", "corrupted"}:
            arguments[key] = other if other is not None else text.replace("cat", "dog")
        elif key in {"layer", "up_to_layer", "head"}:
            arguments[key] = 1
        elif key == "layers":
            arguments[key] = [1]
        elif key == "heads":
            arguments[key] = ["1.1"]
        elif key in {"answer", "wrong", "target_token"}:
            arguments.pop(key)
        elif key == "max_new_tokens":
            arguments[key] = 2
    if name in {"patch_heads", "find_circuit"}:  # two answers whose logit difference the pair moves
        arguments |= _moved_answers(arguments["clean"], arguments["corrupted"], model)
    if name == "plan_kv_cache":  # a short cache the tiny text outlasts, within the tiny model's 64 positions
        arguments |= {"sink": 1, "window": 4, "context_length": 64}
    if name == "find_retrieval_heads":
        arguments["lengths"] = [min(int(v), 48) for v in arguments.get("lengths", [48])]
    if name == "position_sensitivity":  # movable pieces of the tiny text
        first, second = pieces or ("the cat was tired", "the dog sat")
        named = [{"name": "first", "text": first}, {"name": "second", "text": second}]
        arguments |= {"segments": named, "move": "second", "answer": "mat"}
    if name == "compare_prompts":  # plain text (the tiny tokenizer has no chat template) is one segment
        arguments["checks"] = ["value"]
    return arguments


def _moved_answers(clean: str, corrupted: str, model: str = "tiny-llama") -> dict[str, str]:
    """The two one-token words whose logit difference the tiny llama's clean/corrupted pair moves most apart."""
    loaded = load_model(model)
    tokenizer = loaded.tokenizer
    with torch.inference_mode():
        logits = [loaded.model(**tokenizer(t, return_tensors="pt")).logits[0, -1] for t in (clean, corrupted)]
    change = logits[0] - logits[1]
    words = [w for w, i in tokenizer.get_vocab().items() if tokenizer(w, add_special_tokens=False)["input_ids"] == [i]]
    ranked = sorted(words, key=lambda w: float(change[tokenizer.convert_tokens_to_ids(w)]))
    return {"answer": ranked[-1], "wrong": ranked[0]}


TEXT_TOOLS = [
    n for n, spec in TOOLS.items() if {"text", "prompt", "prompt_a", "clean"} & set(spec.input_model.model_fields)
]
NEXT_LINE = re.compile(r"^next: (\w+) ")


@pytest.mark.slow
@pytest.mark.parametrize("name", TEXT_TOOLS)
def test_every_suggested_call_runs_as_printed(name: str, tiny_models, tmp_path) -> None:
    """The calls a report's concise text suggests, copied from the text as printed, run in the same session — long
    texts included: they are printed as handles (a few dozen bytes), never cut with "…"."""
    inspector = Inspector(artifact_dir=tmp_path)
    text = " ".join(["the cat was tired because the dog sat on the mat because"] * 3)  # 170 characters, 37 tokens
    report = TOOLS[name](inspector, _tiny_arguments(name, text))
    printed = concise_text(report)
    lines = [line for line in printed.splitlines() if NEXT_LINE.match(line)]
    assert len(lines) == len(report.next_calls) >= 1 and text not in printed and "…" not in "".join(lines)
    for line in lines:
        tool = NEXT_LINE.match(line).group(1)
        arguments = json.JSONDecoder().raw_decode(line[len(f"next: {tool} ") :])[0]
        assert all(len(v) <= HANDLE_AFTER_CHARS for v in _strings(arguments)), arguments
        TOOLS[tool](inspector, arguments)  # runs as printed
    if name != "find_retrieval_heads":  # its next call names the haystack it built, not the text
        assert any("@text:" in line for line in lines)  # the 170-character text went by handle


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


# --- long inputs: 8,192 tokens (2,000 a prompt for compare_prompts), on a tiny model with room for them ---------

LONG_TOKENS = 8192
# refused before the pass, over the 2 GiB default: 8.5 GiB of maps; find_circuit's EAP-IG backward 20 GiB
REFUSED_AT_8192 = {"inspect_projections", "reconstruct_attention", "find_circuit"}


@pytest.fixture(scope="module")
def long_model():
    import transformers as tf
    from families import VOCAB, tiny_tokenizer

    from agent_tools.loading import register_model

    config = tf.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=2 * LONG_TOKENS,
    )
    import torch

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    tokenizer = tiny_tokenizer()
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and not w.startswith("<")][:20]
    register_model("tiny-long", model, tokenizer)
    return words


@pytest.mark.heavy
@pytest.mark.parametrize("name", TEXT_TOOLS)
def test_budgets_hold_at_8192_tokens(name: str, long_model, tmp_path) -> None:
    words = long_model

    def text(tokens: int, shift: int = 0) -> str:  # the tiny tokenizer: one token a word, plus BOS
        return " ".join(words[(i * 7 + shift) % len(words)] for i in range(tokens - 1))

    long = text(LONG_TOKENS)
    spoken = long.split()
    pieces = (" ".join(spoken[:4]), " ".join(spoken[6:9]))  # disjoint verbatim spans of the long text
    other = " ".join([*spoken[:-2], spoken[-1], spoken[-2]])  # a pair that differs near its end, as pairs do
    arguments = _tiny_arguments(name, long, model="tiny-long", other=other, pieces=pieces)
    if name == "patch_heads":  # exact rows (attribution's backward over 8,192 tokens is refused: 4 GiB of maps)
        arguments["method"] = "exact"
    if name == "compare_prompts":
        arguments |= {"prompt_a": text(2000), "prompt_b": text(2000, 1)}
    # plan_kv_cache's masked rows each hold one layer's eager scores (2 GiB at 8,192 tokens on this eager model;
    # the default model's sdpa holds none): a budget for two rows, as its refusal below 2 rows asks
    budget = 6 * 1024**3 if name == "plan_kv_cache" else DEFAULT_MEMORY_BUDGET
    try:
        report = TOOLS[name](Inspector(artifact_dir=tmp_path, memory_budget=budget), arguments)
    except AttentionToolError as exc:  # refused before the pass (its maps would not fit the memory budget)
        assert name in REFUSED_AT_8192 and exc.kind == "resource_limit" and "budget" in exc.message, exc.message
        return
    assert size(concise_text(report)) <= TEXT_BUDGET
    assert size(report.model_dump(mode="json")) <= REPORT_BUDGET, {
        k: size(v) for k, v in report.model_dump(mode="json").items()
    }
    assert all(len(v) <= HANDLE_AFTER_CHARS for call in report.next_calls for v in _strings(call.arguments))
