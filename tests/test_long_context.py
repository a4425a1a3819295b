"""The long-context tools as corpus tasks: rows match the declared columns; a too-short text is a recorded error."""

from __future__ import annotations

import pytest
from crafted import circuit_tokenizer, induction_circuit

from agent_tools.corpus.tasks import TaskOptions, analyse, columns
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.runs.items import CorpusItem

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
    steps = long_context_steps("long text", "m", 3000)
    assert isinstance(steps, list) and [name for name, _ in steps] == ["find_retrieval_heads", "plan_kv_cache"]
    retrieval, plan = steps[0][1], steps[1][1]
    assert retrieval["lengths"] == [1024] and plan["context_length"] == 3000 and plan["model"] == "m"
    assert LONG_CONTEXT_TOKENS == 1024
