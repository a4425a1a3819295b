"""The long-context tools as corpus tasks: rows match the declared columns; a too-short text is a recorded error."""

from __future__ import annotations

import pytest
from crafted import circuit_tokenizer, induction_circuit

from agent_tools.corpus.tasks import TaskOptions, analyse, columns
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.runs.items import CorpusItem
from agent_tools.tools import get_tool

PROMPT = "red blue green one two three king queen star sun moon tree king"
SEGMENTS = [
    {"name": "needle", "text": "king queen star"},
    {"name": "a", "text": "red blue green"},
    {"name": "b", "text": "one two three"},
]


@pytest.fixture(scope="module")
def circuit() -> LoadedModel:
    return register_model("circuit-corpus", induction_circuit(), circuit_tokenizer())


def test_position_task_rows_have_the_declared_columns(circuit: LoadedModel, inspector: Inspector) -> None:
    item = CorpusItem(index=0, id="x", text=PROMPT, segments=SEGMENTS)
    outcome = analyse(inspector, "position", item, TaskOptions(model="circuit-corpus"))
    assert outcome.error is None and len(outcome.rows) == 3  # the needle before, between and after a and b
    names = [name for name, _ in columns("position")]
    assert all(list(row) == names for row in outcome.rows)
    assert [row["slot"] for row in outcome.rows] == [0, 1, 2] and sum(row["best"] for row in outcome.rows) == 1


def test_long_context_tasks_record_a_too_short_text_as_an_input_error(
    circuit: LoadedModel, inspector: Inspector
) -> None:
    item = CorpusItem(index=0, id="x", text=PROMPT)
    kv = analyse(inspector, "kv_cache", item, TaskOptions(model="circuit-corpus"))
    assert kv.error_kind == "invalid_input" and "covers the whole text" in (kv.error or "")
    retrieval = analyse(inspector, "retrieval", item, TaskOptions(model="circuit-corpus"))
    assert retrieval.error_kind == "resource_limit" and "limit" in (retrieval.error or "")
    assert [n for n, _ in columns("kv_cache")][3:] == [
        "layer",
        "kv_head",
        "loss_change",
        "top_token_agreement",
        "planned",
    ]


def test_analyze_long_context_steps_only_for_long_texts() -> None:
    from agent_tools.report.long_context import LONG_CONTEXT_TOKENS, long_context_steps

    assert "at least 1024" in str(long_context_steps("short", None, 40))
    steps = long_context_steps("long text", "m", 3000)  # two words: no four parts for a U-curve
    assert isinstance(steps, list) and [name for name, _ in steps] == ["find_retrieval_heads", "plan_kv_cache"]
    retrieval, plan = steps[0][1], steps[1][1]
    assert retrieval["lengths"] == [1024] and plan["context_length"] == 3000 and plan["model"] == "m"
    assert plan["window"] == 256 and long_context_steps("t", None, 40, threshold=32)[1][1]["window"] == 10
    assert LONG_CONTEXT_TOKENS == 1024


def test_u_curve_default_segments_are_the_needle_among_four_parts_of_the_text() -> None:
    from agent_tools.long_context import DEFAULT_ANSWER, DEFAULT_NEEDLE, DEFAULT_QUESTION
    from agent_tools.report.long_context import (
        U_CURVE_ANSWER,
        U_CURVE_NEEDLE,
        U_CURVE_QUESTION,
        long_context_steps,
        u_curve_arguments,
    )

    assert (U_CURVE_NEEDLE, U_CURVE_QUESTION, U_CURVE_ANSWER.strip()) == (
        DEFAULT_NEEDLE,
        DEFAULT_QUESTION,
        DEFAULT_ANSWER,
    )
    # a text that repeats itself: cut at the first sentence end after each quarter (characters 19, 39, 59 of 79),
    # a part found earlier in the prompt is named by its occurrence
    text = "Cats sit. Dogs run. " * 4
    arguments = u_curve_arguments(text, 20)  # the whole text fits (no count: by characters per token)
    assert arguments is not None
    parts = ["Cats sit. Dogs run. Cats sit.", "Dogs run. Cats sit.", "Dogs run. Cats sit.", "Dogs run."]
    assert arguments["prompt"] == " ".join([parts[0], U_CURVE_NEEDLE, *parts[1:], U_CURVE_QUESTION])
    assert arguments["segments"] == [
        {"name": "needle", "text": U_CURVE_NEEDLE},
        {"name": "part1", "text": parts[0], "occurrence": 1},
        {"name": "part2", "text": parts[1], "occurrence": 2},  # the first lies inside part 1
        {"name": "part3", "text": parts[2], "occurrence": 3},
        {"name": "part4", "text": parts[3], "occurrence": 4},
    ]
    assert (arguments["move"], arguments["answer"], arguments["positions"]) == ("needle", U_CURVE_ANSWER, 5)
    # the model's count shrinks the text until prompt and answer fit; a text too short for four parts gives none
    shrunk = u_curve_arguments("word " * 400, 400, lambda prompt: len(prompt.split()), limit=60)
    assert shrunk is not None and len((shrunk["prompt"] + U_CURVE_ANSWER).split()) <= 60
    assert u_curve_arguments("two words", 3) is None
    steps = long_context_steps(text * 100, "m", 3000)
    assert isinstance(steps, list) and steps[2][0] == "position_sensitivity" and steps[2][1]["model"] == "m"


# --- the analyze report's long-context section (on a tiny model, the threshold lowered to fit its 64 positions) ---

LONG_TEXT = " ".join(["the cat sat on the mat and looked at the bird in the tree"] * 4)  # 57 tokens on tiny-llama


@pytest.fixture(scope="module")
def tiny_llama() -> LoadedModel:
    from families import build_family, tiny_tokenizer

    return register_model("tiny-llama-long", build_family("llama"), tiny_tokenizer())


@pytest.fixture(scope="module")
def long_analysis(tiny_llama, tmp_path_factory):
    """The analysis of a 57-token text with the threshold lowered to 32, written out. Only the long-context pictures
    are drawn (through the story's drawing table, as draw_pictures does): all 23 take ~30 s on a loaded core."""
    from agent_tools.report.figures import STORY_DRAWINGS, Picture
    from agent_tools.report.job import run_analysis
    from agent_tools.report.outputs import write_outputs
    from agent_tools.report.story import build_story

    result = run_analysis(Inspector(), LONG_TEXT, model="tiny-llama-long", experiment=False, long_context_tokens=32)
    step = {s.key: s for s in build_story(result)}["long_context"]
    for wanted in step.pictures:
        png = STORY_DRAWINGS[wanted.name](result)
        assert png is not None
        result.pictures[wanted.name] = Picture(wanted.name, wanted.caption, png)
    out = tmp_path_factory.mktemp("long-context-report")
    write_outputs(result, out)
    return result, out


def test_u_curve_arguments_of_a_repeating_text_run_as_position_sensitivity(tiny_llama) -> None:
    """The parts found by their occurrence are the parts meant: the needle moves through five distinct places."""
    from agent_tools.report.long_context import u_curve_arguments

    tokenizer = tiny_llama.tokenizer
    count = lambda prompt: len(tokenizer(prompt)["input_ids"])  # noqa: E731
    arguments = u_curve_arguments("Cats sit. Dogs run. " * 4, 24, count, limit=64)
    assert arguments is not None
    report = get_tool("position_sensitivity")(Inspector(), {**arguments, "model": "tiny-llama-long"})
    starts = [p.start_token for p in sorted(report.positions, key=lambda p: p.slot)]
    assert len(starts) == 5 and starts == sorted(set(starts)) and starts[0] <= 1
    assert len({p.prompt_tokens for p in report.positions}) == 1  # the same pieces, rearranged


def test_analyze_long_context_section_states_the_reports_numbers(long_analysis) -> None:
    from agent_tools.report.long_context import NO_U_CURVE, plan_grid
    from agent_tools.report.story import build_story
    from agent_tools.tools.find_retrieval_heads.models import FindRetrievalHeadsReport
    from agent_tools.tools.plan_kv_cache.models import PlanKvCacheReport
    from agent_tools.tools.position_sensitivity.models import PositionSensitivityReport

    result, _ = long_analysis
    assert "long_context" not in result.skipped  # 57 tokens >= the lowered threshold of 32
    retrieval = result.report("find_retrieval_heads", FindRetrievalHeadsReport)
    plan = result.report("plan_kv_cache", PlanKvCacheReport)
    assert retrieval is not None and plan is not None
    assert [h.length for h in retrieval.haystacks] == [57, 57, 57] and plan.window == 57 // 4 and plan.tokens == 57
    step = {s.key: s for s in build_story(result)}["long_context"]
    text = " ".join(step.sentences)
    accuracy = sum(h.accuracy for h in retrieval.haystacks) / len(retrieval.haystacks)
    assert f"copies {accuracy:.0%} of the answer tokens" in text
    assert f"{plan.plan.planned_kv_heads} of {plan.plan.total_kv_heads} KV heads" in text
    assert f"by {plan.plan.verified_loss_change:+.4f} nats" in text
    assert f"saving {plan.memory.saved_fraction:.0%} of the KV cache at 57 tokens" in text
    curve = result.report("position_sensitivity", PositionSensitivityReport)  # the needle among four parts
    assert curve is not None and curve.moved == "needle" and len(curve.positions) == 5
    assert NO_U_CURVE not in step.sentences
    best = next(p for p in curve.positions if p.slot == curve.best_slot)
    worst = next(p for p in curve.positions if p.slot == curve.worst_slot)
    assert best.answer_logprob == max(p.answer_logprob for p in curve.positions)
    assert f"({best.relative_depth:.2f} depth" not in text and f"depth {best.relative_depth:.2f}" in text
    assert f"{best.answer_logprob:.3f} nats) and worst" in text and f"{worst.answer_logprob:.3f} nats)" in text
    assert f"spread {curve.spread:.3f} nats" in text
    assert [p.name for p in step.pictures] == ["story-8-retrieval", "story-8-kv-plan", "story-8-u-curve"]
    values, marks = plan_grid(plan)  # the plan picture's numbers: every KV head's loss change, planned ones marked
    assert len(values) == 2 and len(values[0]) == 2  # tiny-llama: 2 layers × 2 KV heads
    for h in plan.heads:
        assert values[h.layer][h.kv_head] == h.loss_change and (marks[h.layer][h.kv_head] == "S") == h.planned
    assert sum(row.count("S") for row in marks) == plan.plan.planned_kv_heads


def test_analyze_long_context_section_in_every_output(long_analysis) -> None:
    import json

    from rich.console import Console

    from agent_tools.report.content import SECTION_TITLES
    from agent_tools.report.terminal import print_report

    result, out = long_analysis
    for name in ("story-8-retrieval", "story-8-kv-plan", "story-8-u-curve"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert result.pictures[name].png == (out / f"{name}.png").read_bytes()
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    step = next(s for s in report["story"] if s["key"] == "long_context")
    assert [p["name"] for p in step["pictures"]] == ["story-8-retrieval", "story-8-kv-plan", "story-8-u-curve"]
    assert {"find_retrieval_heads", "plan_kv_cache", "position_sensitivity"} <= set(report["reports"])
    page = (out / "report.html").read_text(encoding="utf-8")
    assert step["title"] in page and SECTION_TITLES["plan_kv_cache"] in page and step["sentences"][0] in page
    console = Console(record=True, width=200)
    print_report(result, console)
    shown = console.export_text()
    assert step["title"] in shown and "story-8-kv-plan.png" in shown and SECTION_TITLES["find_retrieval_heads"] in shown


def test_analyze_long_context_sentences_with_a_retrieving_model(long_analysis) -> None:
    from agent_tools.report.long_context import NO_U_CURVE, long_context_sentences
    from agent_tools.tools.find_retrieval_heads.models import FindRetrievalHeadsReport, RetrievalHead

    result, _ = long_analysis
    measured = result.report("find_retrieval_heads", FindRetrievalHeadsReport)
    assert measured is not None
    head = RetrievalHead(layer=1, head=2, score=0.75, score_sd=0.1, score_min=0.6, score_max=0.9)
    causal = measured.causal.model_copy(
        update={
            "ablated": ["1.2"],
            "accuracy_clean": 0.8,
            "accuracy_top_ablated": 0.2,
            "accuracy_random_mean": 0.7,
            "accuracy_random_sd": 0.05,
        }
    )
    report = measured.model_copy(update={"heads": [head], "causal": causal})
    first, second, no_u_curve = long_context_sentences(report, None, None)
    assert "1 heads score above 0; the best, L1H2, scores 0.75 ± 0.10" in first
    assert "leaves 20% answer-token accuracy (full model 80%), against 70% ± 5% with 1 random heads" in second
    assert no_u_curve == NO_U_CURVE  # no position_sensitivity report: the section says why there is no U-curve


def test_analyze_skips_the_long_context_section_for_a_short_text_or_when_asked(tiny_llama) -> None:
    from agent_tools.cli import build_parser
    from agent_tools.report.job import run_analysis
    from agent_tools.report.story import build_story

    short = run_analysis(Inspector(), "the cat sat on the mat", model="tiny-llama-long", experiment=False)
    assert (
        short.skipped["long_context"]
        == f"text has {len(short.tokens)} tokens; the long-context steps need at least 1024"
    )
    assert "plan_kv_cache" not in short.reports and "long_context" not in [s.key for s in build_story(short)]
    off = run_analysis(
        Inspector(), LONG_TEXT, model="tiny-llama-long", experiment=False, long_context=False, long_context_tokens=32
    )
    assert (
        off.skipped["long_context"] == "not asked for (--no-long-context)" and "find_retrieval_heads" not in off.reports
    )
    assert build_parser().parse_args(["analyze", "--no-long-context"]).no_long_context is True
    assert build_parser().parse_args(["analyze"]).no_long_context is False
