"""find_retrieval_heads' words, from the measured scores and the ablation check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.analysis.metrics import BASELINE_SIGMAS, chance_margin
from agent_tools.schemas import Finding, head_label
from agent_tools.wording import head_name


@dataclass(frozen=True)
class RetrievalNumbers:
    haystacks: int
    lengths: Sequence[int]
    depths: Sequence[float]
    top: Sequence[tuple[int, int, float, float]]  # (layer, head, mean score, sd), best first
    accuracy_clean: float
    accuracy_top: float
    accuracy_random: float
    accuracy_random_sd: float
    draws: int


def verdict(n: RetrievalNumbers) -> str:
    """The ablation's reading: the top heads matter when removing them costs more than random heads, by more than
    two standard deviations of the random draws (and at least 0.05 of accuracy)."""
    drop_top = n.accuracy_clean - n.accuracy_top
    drop_random = n.accuracy_clean - n.accuracy_random
    margin = chance_margin(n.accuracy_random_sd, sds=BASELINE_SIGMAS, floor=0.05)
    if n.accuracy_clean < 0.2:
        return (
            f"the model retrieves only {n.accuracy_clean:.0%} of answer tokens even with every head, so the ablation "
            "cannot show which heads it needs"
        )
    if drop_top > drop_random + margin:
        return (
            f"retrieval needs them: ablating the top heads drops answer accuracy by {drop_top:.2f} vs "
            f"{drop_random:.2f} ± {n.accuracy_random_sd:.2f} for random heads ({n.draws} draws)"
        )
    return (
        f"not shown: ablating the top heads drops answer accuracy by {drop_top:.2f}, random heads by {drop_random:.2f} "
        f"± {n.accuracy_random_sd:.2f} ({n.draws} draws)"
    )


def summary(n: RetrievalNumbers) -> str:
    best = ", ".join(f"{head_label(layer, head)} {score:.2f}±{sd:.2f}" for layer, head, score, sd in n.top[:4])
    lengths = "/".join(str(x) for x in n.lengths)
    return (
        f"Over {n.haystacks} needle-in-a-haystack prompts ({len(n.depths)} depths × lengths {lengths}) the model "
        f"copies {n.accuracy_clean:.0%} of answer tokens; retrieval heads (Wu et al. score, mean ± sd over "
        f"prompts): {best or 'none'}. "
        f"Causal check: {verdict(n)}."
    )


def findings(n: RetrievalNumbers) -> list[Finding]:
    found = [
        Finding(
            kind="retrieval_head",
            severity="high" if index == 0 else "medium",
            layer=layer,
            head=head,
            value=score,
            detail=f"{head_name(layer, head)}: while the answer is copied, its most-attended token is the needle "
            f"token being copied {score:.0%} of the time (sd {sd:.2f} over depths and lengths)",
        )
        for index, (layer, head, score, sd) in enumerate(n.top[:3])
    ]
    found.append(
        Finding(kind="retrieval_ablation", severity="high", value=n.accuracy_top, detail=f"causal check: {verdict(n)}")
    )
    return found
