"""The per-layer tools on the families routed through adapters (BLOOM, MPT, Falcon, DeBERTa-v2): the step-by-step
reconstruction ends at the model's own map with the family's additive term as a stage, and the facts are right."""

from __future__ import annotations

import adapted
import pytest
from families import tiny_tokenizer

from agent_tools.inspector import Inspector
from agent_tools.loading import register_model
from agent_tools.tools import get_tool

TERMS = {"bloom": ["ALiBi"], "mpt": ["ALiBi"], "falcon_alibi": ["ALiBi"], "falcon": [], "falcon_mq": []}
TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def registered() -> dict[str, str]:
    tokenizer = tiny_tokenizer()
    names = {}
    for family in TERMS:
        names[family] = f"tiny-adapted-{family}"
        register_model(names[family], adapted.build(family), tokenizer)
    return names


@pytest.mark.parametrize("family", list(TERMS))
def test_reconstruction_ends_at_the_models_map_with_the_family_term(family: str, registered, tmp_path) -> None:
    inspector = Inspector(artifact_dir=tmp_path)
    for layer in (0, 1):
        report = get_tool("reconstruct_attention")(
            inspector, {"model": registered[family], "text": TEXT, "layer": layer, "head": 1, "detail": "full"}
        )
        assert report.matches_model and report.model_weight_error <= 1e-5
        assert report.score_terms == TERMS[family]
        if TERMS[family]:  # the term is a stage of its own, not folded into the positions
            assert any("ALiBi" in stage.added for stage in report.stages)


def test_falcon_alibi_layers_are_rebuilt_without_the_rotary_it_ignores(registered, tmp_path) -> None:
    """Falcon hands (cos, sin) to its ALiBi layers too; rotating q and k with them would rebuild a different map."""
    report = get_tool("reconstruct_attention")(
        Inspector(artifact_dir=tmp_path), {"model": registered["falcon_alibi"], "text": TEXT, "layer": 0, "head": 0}
    )
    assert report.positional_score_error <= 1e-5 and report.matches_model


def test_mpt_reads_its_context_length_from_max_seq_len(registered, tmp_path) -> None:
    report = get_tool("describe_model")(Inspector(artifact_dir=tmp_path), {"model": registered["mpt"]})
    assert report.max_positions == 64
