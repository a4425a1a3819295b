"""attention-explainer: agent tools that look inside a Hugging Face transformer and explain its attention."""

from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Inspector
from agent_tools.loading import DEFAULT_MODEL, ModelPolicy, load_model

__all__ = ["DEFAULT_MODEL", "AttentionToolError", "Inspector", "ModelPolicy", "load_model"]
__version__ = "0.1.0"
