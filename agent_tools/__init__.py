"""attention-explainer: agent tools that look inside a Hugging Face transformer and explain its attention.

The names below load on first use (PEP 562), so importing a light submodule (``agent_tools.settings``, the
command line's parser) does not import torch and transformers. ``__version__`` too: it is read from the
installed package's metadata (written once, in ``pyproject.toml``), which costs ~25 ms the CLI's ``--help``
need not pay.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_tools.errors import AttentionToolError
    from agent_tools.inspector import Inspector
    from agent_tools.loading import ModelPolicy, load_model
    from agent_tools.settings import DEFAULT_MODEL
    from agent_tools.surfaces.notebook import Explainer

    __version__: str

DISTRIBUTION = "attention-explainer"
UNKNOWN_VERSION = "0+unknown"  # a source checkout used without installing it: no metadata to read

_EXPORTS = {
    "AttentionToolError": "agent_tools.errors",
    "DEFAULT_MODEL": "agent_tools.settings",
    "Explainer": "agent_tools.surfaces.notebook",
    "Inspector": "agent_tools.inspector",
    "ModelPolicy": "agent_tools.loading",
    "load_model": "agent_tools.loading",
}
__all__ = [
    "DEFAULT_MODEL",
    "AttentionToolError",
    "Explainer",
    "Inspector",
    "ModelPolicy",
    "__version__",
    "load_model",
]


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN_VERSION


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = _installed_version()
        globals()["__version__"] = value  # read the metadata once
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_tools' has no attribute {name!r}")
    return getattr(import_module(module), name)
