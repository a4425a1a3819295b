"""Fixtures only: real bundled models are loaded once per test session; tiny models are built from configs.

Shared builders and references live in helper modules (families.py, crafted.py, reference.py, mcp_process.py,
scripted_chat.py); test files never import each other or this file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import pytest
from families import FAMILIES, build_family, tiny_tokenizer

from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, load_model, register_model


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
