"""Fixtures only: real bundled models are loaded once per test session; tiny models are built from configs.

Shared builders and references live in helper modules (families.py, crafted.py, reference.py, mcp_process.py,
scripted_chat.py, example_runs.py); test files never import each other or this file.

Under ``pytest -n 2 --dist loadgroup`` (README) each test file is one xdist group, so that its module fixtures are
set up in one worker; files marked ``xdist_group("NAME")`` share a group (and a worker) to share a session fixture."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import pytest
from families import FAMILIES, build_family, tiny_tokenizer

from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, load_model, register_model

if TYPE_CHECKING:
    from example_runs import ExampleRuns


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


@pytest.fixture(scope="session")
def example_runs(smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> ExampleRuns:
    """Every tool's example run once on the default model (tests/example_runs.py)."""
    from example_runs import ExampleRuns  # imports every tool: only for the tests that ask

    return ExampleRuns(Inspector(artifact_dir=tmp_path_factory.mktemp("example-runs")))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): test files that share an xdist worker (conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One xdist group per test file unless the file names a shared one (read by ``--dist loadgroup`` only)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


@pytest.fixture()
def inspector(tmp_path: Path) -> Inspector:
    return Inspector(artifact_dir=tmp_path / "artifacts")
