"""position_sensitivity: the reordering by hand, the numbers against a direct forward, bad input."""

from __future__ import annotations

import pytest
import torch
from crafted import circuit_tokenizer, induction_circuit

from agent_tools.capture import attention_implementation
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.tools import get_tool
from agent_tools.tools.position_sensitivity.models import PositionSensitivityInput
from agent_tools.tools.position_sensitivity.narrative import curve_shape
from agent_tools.tools.position_sensitivity.plan import _locate, _slots, _variant

DOCS = {"a": "red blue green", "b": "one two three", "needle": "king queen star", "d": "sun moon tree"}
PROMPT = "red blue green one two three king queen star sun moon tree king"


def _arguments(**extra: object) -> dict:
    return {
        "model": "circuit-position",
        "prompt": PROMPT,
        "segments": [{"name": name, "text": text} for name, text in DOCS.items()],
        "move": "needle",
        "answer": "queen",
        **extra,
    }


def test_variants_keep_the_gaps_and_move_one_segment() -> None:
    args = PositionSensitivityInput.model_validate(_arguments())
    index, spans = _locate(args)
    assert index is None and [name for _, _, name in spans] == ["a", "b", "needle", "d"]
    assert _variant(args, index, spans, 0) == "king queen star red blue green one two three sun moon tree king"
    assert _variant(args, index, spans, 3) == "red blue green one two three sun moon tree king queen star king"
    assert _slots(4, 3) == [0, 2, 3] and _slots(4, 8) == [0, 1, 2, 3]
    assert curve_shape([-1.0, -2.0, -1.5]) == "u_shaped" and curve_shape([-1.0, -1.01]) == "flat"
    assert curve_shape([-2.0, -1.0, -1.5]) == "other"


@pytest.fixture(scope="module")
def circuit() -> LoadedModel:
    return register_model("circuit-position", induction_circuit(), circuit_tokenizer())


def test_each_position_equals_a_direct_forward(circuit: LoadedModel, inspector: Inspector) -> None:
    report = get_tool("position_sensitivity")(inspector, {**_arguments(), "positions": 4, "detail": "full"})
    assert [p.slot for p in report.positions] == [0, 1, 2, 3]
    assert [p.start_token for p in report.positions] == [1, 4, 7, 10]  # <bos> first, three words per segment
    args = PositionSensitivityInput.model_validate(_arguments())
    index, spans = _locate(args)
    tokenizer = circuit.tokenizer
    for result in report.positions:
        text = _variant(args, index, spans, result.slot) + " queen"
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.inference_mode(), attention_implementation(circuit.model, "eager"):
            output = circuit.model(input_ids=ids, output_attentions=True)
        row = ids.shape[1] - 2  # the query that produces 'queen'
        logprob = torch.log_softmax(output.logits[0, row].float(), -1)[ids[0, -1]]
        span = list(range(result.start_token, result.start_token + 3))
        share = torch.stack([a[0, :, row, span].sum(-1) for a in output.attentions]).mean()
        assert result.answer_logprob == pytest.approx(float(logprob), abs=1e-3)
        assert result.attention_share == pytest.approx(float(share), abs=1e-3)
    assert report.best_slot in (0, 1, 2, 3) and report.spread >= 0


def test_bad_input_names_what_is_valid(circuit: LoadedModel, inspector: Inspector) -> None:
    tool = get_tool("position_sensitivity")
    with pytest.raises(InvalidInputError, match="is not a segment"):
        tool(inspector, _arguments(move="nowhere"))
    with pytest.raises(InvalidInputError, match="verbatim substring"):
        tool(
            inspector,
            {**_arguments(), "segments": [{"name": "needle", "text": "king queen"}, {"name": "x", "text": "bird"}]},
        )
