"""What the story's pictures and the page's views are drawn from, as plain numbers (no tensors leave here).

Three sources, each turned into small lists once, right after the passes:

* the focus head's reconstruction (:class:`~agent_tools.tools.reconstruct_attention.Reconstruction`): every
  stage's map on the first :data:`STORY_WINDOW` tokens, the counterfactual with Q = K = V = x, and — for the
  page's neuron view — the head's q and k for every token (float32, so the page's softmax equals the model's);
* the top induction head on the seeded random probe ``[BOS] r₁…r_N r₁…r_N``, where its behaviour is visible
  (on ordinary text an induction head mostly idles on the first token);
* nothing else: every other picture is drawn from the tools' reports.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch

from agent_tools.analysis.metrics import masked_softmax
from agent_tools.analysis.reconstruct import project_queries_keys
from agent_tools.consumers.head_map import HeadMapConsumer
from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.probes import build_probe
from agent_tools.schemas import Token
from agent_tools.tools.profile_heads.models import TopHead
from agent_tools.tools.reconstruct_attention import Reconstruction

STORY_WINDOW = 32  # tokens shown in the stage pictures (rows and columns)
NEURON_TOKENS = 384  # the neuron view carries q and k for texts up to this many tokens


def _grid(weights: torch.Tensor, size: int) -> list[list[float]]:
    """The top-left ``size`` × ``size`` block of a (T, T) map, rounded for reading."""
    return [[round(float(v), 5) for v in row] for row in weights[:size, :size].tolist()]


def tensor_b64(tensor: torch.Tensor) -> str:
    """A tensor's bytes (little-endian, C order) as base64: how the page receives arrays."""
    return base64.b64encode(tensor.contiguous().numpy().tobytes()).decode("ascii")


@dataclass(frozen=True)
class StageViews:
    """The focus head's five stages and the Q = K = V = x counterfactual, on the first ``len(labels)`` tokens."""

    layer: int
    head: int
    labels: list[str]  # "position:token" of the window
    stage_names: list[str]
    stage_divisors: list[float]  # what each stage divides the dot products by
    stage_weights: list[list[list[float]]]  # stage -> window × window
    counterfactual: list[list[float]]  # Q = K = V = x (no projections, no positions), the model's scale and mask
    masked_every_stage: bool  # the model's mask was applied at stages 1–4 too (rows are then exact in the window)
    length: int  # tokens in the text (the window may be shorter)


@dataclass(frozen=True)
class NeuronData:
    """The focus head's q and k for every token (float32, base64) and how its scores are formed."""

    layer: int
    head: int
    length: int
    head_dim: int
    scale: float  # the model's factor on q·k
    softcap: float | None
    q: str  # base64 of (T, d_head) float32
    k: str  # base64 of (T, d_head) float32
    allowed: str  # base64 of (T, T) uint8, 1 = the query may read the key


@dataclass(frozen=True)
class ProbeView:
    """The top induction head's map on the probe it was measured on."""

    layer: int
    head: int
    labels: list[str]
    weights: list[list[float]]
    repeat_length: int  # N tokens per copy
    induction_share: float  # mean weight second-copy queries give the token after their earlier occurrence
    seed: int
    qualifies: bool  # the share reaches the induction role's threshold
    threshold: float


def stage_views(rebuilt: Reconstruction, tokens: list[Token], *, window: int = STORY_WINDOW) -> StageViews:
    """Every stage's map and the counterfactual on the first ``window`` tokens of the focus head."""
    inputs, report = rebuilt.inputs, rebuilt.report
    size = min(window, len(tokens))
    allowed = inputs.allowed()[:size]  # (window, T): only the window's rows are drawn
    x = inputs.x.float()
    scores = (x[:size] @ x.T) * inputs.effective_scale  # (window, T) Q = K = x
    counterfactual = masked_softmax(scores, allowed if inputs.mask is not None else None)
    return StageViews(
        layer=report.layer,
        head=report.head,
        labels=[f"{t.position}:{t.text}" for t in tokens[:size]],
        stage_names=[s.name for s in report.stages],
        stage_divisors=[s.divisor for s in report.stages],
        stage_weights=[_grid(stage.weights, size) for stage in rebuilt.stages],
        counterfactual=_grid(counterfactual, size),
        masked_every_stage=all(s.masked for s in report.stages),
        length=len(tokens),
    )


def neuron_data(rebuilt: Reconstruction) -> NeuronData | None:
    """q and k of the focus head for the neuron view (None for texts over :data:`NEURON_TOKENS` tokens)."""
    inputs = rebuilt.inputs
    length = inputs.x.shape[0]
    if length > NEURON_TOKENS:
        return None
    p = inputs.projections
    q, k = project_queries_keys(
        inputs.x, w_q=p.w_q, w_k=p.w_k, b_q=p.b_q, b_k=p.b_k, query_prescale=p.query_prescale, rotary=inputs.rotary
    )  # (T, d_head) each; q already carries the family's prescale
    return NeuronData(
        layer=rebuilt.report.layer,
        head=rebuilt.report.head,
        length=length,
        head_dim=int(q.shape[-1]),
        scale=float(inputs.scaling),
        softcap=inputs.softcap,
        q=tensor_b64(q.float().cpu()),
        k=tensor_b64(k.float().cpu()),
        allowed=tensor_b64(inputs.allowed().to(torch.uint8).cpu()),
    )


def probe_view(
    inspector: Inspector, loaded: LoadedModel, chosen: TopHead, threshold: float, *, seed: int, repeat_length: int
) -> ProbeView | None:
    """One head's map on the seeded probe profile_heads measured induction on (the same seed gives the same
    tokens), with what profile_heads measured of it (``chosen``, against the role's ``threshold``); None when the
    probe cannot be built for this model."""
    try:
        probe = build_probe(inspector, loaded, repeat_length, seed)
        consumer = HeadMapConsumer(chosen.layer, chosen.head)
        inspector.run(loaded, probe.encoded, [consumer], layers=[chosen.layer], need_output=False)
    except AttentionToolError:
        return None
    weights, _allowed = consumer.result()
    return ProbeView(
        layer=chosen.layer,
        head=chosen.head,
        labels=[f"{t.position}:{t.text}" for t in probe.encoded.tokens],
        weights=_grid(weights.float(), len(probe.encoded.tokens)),
        repeat_length=probe.repeat_length,
        induction_share=chosen.score,
        seed=seed,
        qualifies=chosen.qualifies,
        threshold=threshold,
    )
