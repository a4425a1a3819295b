"""Shared fixtures: real bundled models are loaded once per test session; tiny models are built from configs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import pytest
import torch
from families import FAMILIES, build_family, tiny_tokenizer

from agent_tools.capture import attention_implementation
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, load_model, register_model

ATOL = 1e-5
SAMPLE_TEXT = "The cat sat on the mat because it was tired, and the dog watched it from the door."


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def minilm() -> LoadedModel:
    return load_model("minilm-l6")


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, LoadedModel]:
    """Every family as a registered tiny model named ``tiny-<family>`` (usable as a tool's ``model``)."""
    tokenizer = tiny_tokenizer()
    return {name: register_model(f"tiny-{name}", build_family(name), tokenizer) for name in FAMILIES}


@pytest.fixture()
def inspector(tmp_path: Path) -> Inspector:
    return Inspector(artifact_dir=tmp_path / "artifacts")


def eager_reference(model: torch.nn.Module, **inputs: torch.Tensor):
    """The model's own eager forward with output_attentions (the reference we must match)."""
    with attention_implementation(model, "eager"), torch.inference_mode():
        return model(**inputs, output_attentions=True)


def output_tensor(output) -> torch.Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state
