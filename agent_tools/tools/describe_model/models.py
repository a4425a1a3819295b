"""describe_model's arguments and report."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.schemas import ModelInput, Report, Rounded, Rounded6

DESCRIPTION = (
    "Call first: the model's layers, heads, KV heads, head_dim, score scale vs 1/sqrt(d_k), positions and mask "
    "(the valid layer and head ranges)."
)


class StackDescription(BaseModel):
    """One attention stack: a single-stack model has 'self'; an encoder–decoder 'encoder', 'decoder', 'cross'."""

    name: str = Field(description="the value tools take as attention=")
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = Field(description="value width per head")
    qk_dim: int = Field(description="q·k width per head (d_k of the scale; differs from head_dim for MLA)")
    scaling: Rounded6
    scaling_ratio: Rounded = Field(description="scaling · sqrt(qk_dim): 1.0 means the standard 1/sqrt(d_k)")
    causal: bool
    score_terms: list[str] = Field(description="additive score terms the family adds (e.g. relative position bias)")


class MemoryNeeds(BaseModel):
    """What loading the model with the operator's placement needs, estimated from its config (bytes)."""

    dtype: str = Field(description="the precision the placement loads")
    weights_bytes: int = Field(description="parameters and buffers in that precision")
    load_copy_bytes: int = Field(description="the checkpoint file mapped while its tensors are loaded")
    working_set_bytes: int = Field(description="one forward over working_set_tokens tokens, beyond the weights")
    working_set_tokens: int
    peak_bytes: int = Field(description="weights + the larger of the load copy and the working set")


class DescribeModelInput(ModelInput):
    """Arguments of describe_model."""


class ModelDescription(Report):
    family: str = Field(description="transformers model_type, e.g. llama, bert")
    architecture: str
    num_layers: int
    num_heads: int = Field(description="query heads per layer")
    num_kv_heads: int = Field(description="key/value heads per layer (fewer than num_heads = grouped-query attention)")
    kv_groups: int = Field(description="query heads sharing each KV head")
    head_dim: int = Field(description="d_k: dimensions per head")
    hidden_size: int
    scaling: Rounded6 = Field(description="the factor the model multiplies q·k by")
    inverse_sqrt_head_dim: Rounded6 = Field(description="1/sqrt(head_dim) for comparison")
    scaling_ratio: Rounded = Field(description="scaling · sqrt(head_dim): 1.0 means the standard 1/sqrt(d_k)")
    query_prescaled: bool = Field(description="the scale is folded into the query projection (e.g. OPT)")
    positional: str = Field(description="how positions enter attention")
    causal: bool = Field(description="True: each token reads only earlier tokens (decoder); False: bidirectional")
    mask: str
    max_positions: int | None
    sliding_window: int | None
    softcap: float | None = Field(description="attention logit soft-capping: scores = c·tanh(scores/c)")
    num_parameters: int
    language_model: bool = Field(description="has a next-token head (ablation reports KL of the next token)")
    placement: str = Field(description="how the operator loads models: dtype@device, device map, offload")
    dtype_reason: str = Field(
        default="", description="why the placement loads this dtype (auto's choice and its reason)"
    )
    stacks: list[StackDescription] = Field(
        default_factory=list, description="every attention stack: layers, heads, widths, scale, mask, score terms"
    )
    weights_bytes: dict[str, int] = Field(
        description="bytes the weights need in each precision (parameters × dtype size + buffers); the loaded "
        "dtype is the report's dtype"
    )
    weights_loaded: bool = Field(
        default=True, description="False: described from the config on the meta device, no weight read"
    )
    memory: MemoryNeeds | None = Field(default=None, description="the memory the placement's load would need")
