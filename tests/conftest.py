"""Fixtures only: real bundled models are loaded once per test session; tiny models are built from configs.

Shared builders and references live in helper modules (families.py, crafted.py, reference.py, mcp_process.py,
scripted_chat.py, example_runs.py); test files never import each other or this file.

Under ``pytest -n 2 --dist loadfile`` (README) each test file runs in one worker (its module fixtures are set up
once); the files in ``WORKER_GROUPS`` run in one worker together (to share a session fixture), and the files in
``RUN_FIRST`` (the longest) are handed out first, so that no long file starts last while the other worker idles."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# two xdist workers share 2 cores: OpenMP threads that spin while they wait make each other's small forwards up to
# 20x slower. Set before torch loads (in each worker and in the CLI and MCP subprocesses the tests start).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# auto stays float32 on CPUs with bfloat16 hardware (AMX, AVX-512 BF16), here and in the CLI and MCP subprocesses
# the tests start: the parity checks (1e-5) and the numbers the tests pin are float32's, on every machine.
# tests/test_placement.py covers the bfloat16 choice itself with this unset.
os.environ["ATTENTION_EXPLAINER_CPU_BF16"] = "0"
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


# --- test files on xdist workers (``-n 2 --dist loadfile``) ----------------------------------------------------
# ``--dist loadgroup`` would group by ``xdist_group`` marks, but with pytest 9.2 it silently stops grouping
# (pytest-dev/pytest-xdist#1386): the grouping is done here, by file name, in loadfile's own scheduler.
WORKER_GROUPS = {"test_budgets.py": "example_runs", "test_langchain.py": "example_runs"}  # the example_runs fixture
# The longest files, longest first (CPU seconds of each file's run, its subprocesses included, 2026-12-02: mcp 147,
# cli 131, notebook 104, budgets + langchain 94, corpus 90, placement 38); the others follow in xdist's own order
# (most tests first), small units that fill the end evenly.
RUN_FIRST = (
    "test_mcp.py",
    "test_cli.py",
    "test_notebook.py",
    "test_budgets.py",
    "test_langchain.py",
    "test_corpus.py",
    "test_placement.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the files of a ``WORKER_GROUPS`` group as one unit, handed out in the order of the
    collection (``pytest_collection_modifyitems`` below puts ``RUN_FIRST`` first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return WORKER_GROUPS.get(Path(scope).name, scope)

    config.option.loadscopereorder = False  # the collection's order, not the number of tests in each file
    return GroupedFiles(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In an xdist worker: the ``RUN_FIRST`` files first, then the others with the most tests first (xdist's own
    order); each file's tests keep their order. A plain run keeps the collection's order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    counts = Counter(item.path.name for item in items)
    first = {name: rank for rank, name in enumerate(RUN_FIRST)}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(
        key=lambda item: (
            first.get(item.path.name, len(first)),
            -counts[item.path.name],
            item.path.name,
            position[id(item)],
        )
    )


@pytest.fixture()
def inspector(tmp_path: Path) -> Inspector:
    return Inspector(artifact_dir=tmp_path / "artifacts")
