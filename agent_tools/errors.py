"""Expected failures: what an agent (or a person) can cause by sending bad input.

Every surface turns an :class:`AttentionToolError` into its own error channel (a LangChain tool message with
``status="error"``, an MCP tool error, a one-line CLI error with exit code 2). Anything else is a bug and
still raises.
"""

from __future__ import annotations

from typing import Literal, get_args

ErrorKind = Literal[
    "invalid_input",
    "model_not_found",
    "model_refused",
    "unsupported_model",
    "resource_limit",
    "cancelled",
    "deadline_exceeded",
]
ERROR_KINDS: tuple[str, ...] = get_args(ErrorKind)


class AttentionToolError(ValueError):
    """An error the caller can fix; the message always says what is valid."""

    kind: ErrorKind = "invalid_input"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, str | None]:
        return {"error": self.kind, "message": self.message, "field": self.field}


class InvalidInputError(AttentionToolError):
    kind: ErrorKind = "invalid_input"


class ModelNotFoundError(AttentionToolError):
    kind: ErrorKind = "model_not_found"


class ModelRefusedError(AttentionToolError):
    """The reference exists but policy refuses it (remote code, not on the allow-list)."""

    kind: ErrorKind = "model_refused"


class UnsupportedModelError(AttentionToolError):
    """The family does not route attention through the interface we hook: we refuse rather than guess."""

    kind: ErrorKind = "unsupported_model"


class ResourceLimitError(AttentionToolError):
    kind: ErrorKind = "resource_limit"


class CallCancelledError(AttentionToolError):
    """The call was stopped before it finished because its client cancelled it (MCP ``notifications/cancelled``).

    Raised from the checkpoints of a running pass (between layers, query chunks, generation steps, and while
    waiting for the model's lock), so the pass unwinds through its ``finally`` blocks and the lock is released.
    """

    kind: ErrorKind = "cancelled"


class DeadlineExceededError(CallCancelledError):
    """The call ran past the operator's time limit (``mcp --call-timeout``) and was stopped the same way."""

    kind: ErrorKind = "deadline_exceeded"
