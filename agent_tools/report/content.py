"""What every output of an ``analyze`` run shows besides the story: section titles and the question each
section answers, the model card, the layer × head grids, and the heads worth a picture.

Shared by the terminal, the HTML page, the pictures and the notebook, so they say the same things.
"""

from __future__ import annotations

from typing import Any

from agent_tools.report.job import AnalysisResult
from agent_tools.schemas import Report

SECTION_TITLES = {
    "describe_model": "Model",
    "diagnose_collapse": "Collapse and sinks",
    "explain_scaling": "What 1/sqrt(d_k) does here",
    "profile_heads": "What each head does",
    "inspect_projections": "Projections W_q, W_k, W_v",
    "reconstruct_attention": "Attention rebuilt step by step",
    "scaling_experiment": "Training with and without the scale",
    "find_retrieval_heads": "Retrieval heads (needle in a haystack)",
    "plan_kv_cache": "A short KV cache: which heads need the full context",
    "position_sensitivity": "Where the evidence sits: the U-curve",
}

# What each section's numbers mean for the reader's question (one or two sentences, shown above its findings).
SECTION_QUESTIONS = {
    "diagnose_collapse": (
        "Does any head put (almost) all its weight on one token whatever the query — and does that hurt? A max "
        "weight near 1 means collapsed; the contribution ratio says whether the chosen key writes anything "
        "(below 0.5: a no-op sink); whether a collapse matters is measured by removing the head (mean- and "
        "resample-ablation against random heads)."
    ),
    "explain_scaling": (
        "What would the softmax do without 1/sqrt(d_k)? Var(q·k) far above 1 means saturated rows; a Jacobian "
        "trace near 0 means almost no gradient flows back to W_q and W_k."
    ),
    "profile_heads": (
        "What does each head do? A role score is the share of attention the role's pattern receives (0 to 1); a "
        "head has the role when the score reaches the role's threshold."
    ),
    "inspect_projections": (
        "Do W_q and W_k turn one input into 'what I look for' and 'what I offer'? Mean cos² near the random value "
        "means different subspaces; Q = K = V = x shows what attention would do without them (JS divergence: 0 "
        "same map, ln 2 = 0.693 nats disjoint)."
    ),
    "reconstruct_attention": (
        "Which ingredient makes this head attend the way it does? Each stage's JS divergence to the model's map "
        "(mask held fixed) shows how much of the way that stage goes."
    ),
    "scaling_experiment": (
        "Does training stall without the scale? Compare each run's final loss with the chance loss ln(labels) "
        "and watch ‖∂L/∂W_q‖: near 0 nothing is learned."
    ),
    "find_retrieval_heads": (
        "Which heads copy a fact from far back? A retrieval score is the share of answer tokens at which the head's "
        "most-attended key is the needle token being copied (0 to 1); the causal check ablates the top heads "
        "against random heads of the same count."
    ),
    "plan_kv_cache": (
        "Which KV heads could keep only the first and the last tokens? A head's loss change is the rise of the "
        "next-token loss, in nats, when it reads only sink + window tokens; the plan is verified with every "
        "planned head restricted at once."
    ),
    "position_sensitivity": (
        "Does the answer depend on where the evidence sits? The needle sentence moves through five positions among "
        "four parts of the text; log p(answer) per position, best and worst named (lost in the middle: a U-curve)."
    ),
}

ROLE_ABBREVIATIONS = {
    "previous_token": "prev",
    "induction": "ind",
    "duplicate_token": "dup",
    "first_token": "sink",
    "self": "self",
    "local": "loc",
    "broad": "brd",
    "special_token": "spec",
    "punctuation": "punc",
    "next_token": "next",
}
TEXT_ROLES_PICTURED = {"previous_token", "self", "local"}  # probe roles (induction, duplicate) are drawn on the probe

CARD_FIELDS = (
    "family",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "scaling",
    "scaling_ratio",
    "positional",
    "mask",
    "max_positions",
    "num_parameters",
)


def sections(result: AnalysisResult) -> list[tuple[str, str, Report]]:
    """(title, the question its numbers answer or "", report) of every analysis but the model card, in run order."""
    return [
        (SECTION_TITLES.get(name, name), SECTION_QUESTIONS.get(name, ""), report)
        for name, report in result.reports.items()
        if name != "describe_model"
    ]


def model_card(result: AnalysisResult) -> list[tuple[str, Any]]:
    """The model card (shown once): describe_model's key facts and the run's, or only the run's."""
    description = result.reports.get("describe_model")
    facts = [(key, getattr(description, key)) for key in CARD_FIELDS] if description is not None else []
    return [*facts, ("tokens", len(result.tokens)), ("dtype", result.dtype), ("device", result.device)]


def top_heads(result: AnalysisResult, count: int = 3) -> list[tuple[str, int, int]]:
    """(why, layer, head) for the heads worth a picture on the text: most collapsed, strongest sink, broadest,
    and the top head of each text role (induction and duplicate-token heads are pictured on their probe)."""
    maps = result.maps
    heads = maps.normalised_entropy.shape[1]
    chosen: list[tuple[str, int, int]] = []

    def add(why: str, flat_index: int) -> None:
        layer, head = divmod(int(flat_index), heads)
        if all((layer, head) != (c[1], c[2]) for c in chosen):
            chosen.append((why, layer, head))

    for index in maps.normalised_entropy.flatten().argsort()[:count].tolist():
        add("most concentrated", index)
    for index in maps.first_token_share.flatten().argsort(descending=True)[:count].tolist():
        add("strongest first-token sink", index)
    for index in maps.normalised_entropy.flatten().argsort(descending=True)[:1].tolist():
        add("broadest", index)
    report = result.reports.get("profile_heads")
    for role in getattr(report, "roles", []):
        qualified = [t for t in role.top if t.qualifies]
        if qualified and role.role in TEXT_ROLES_PICTURED:
            add(
                f"top {role.role.replace('_', '-')} head, score {qualified[0].score:.2f}",
                qualified[0].layer * heads + qualified[0].head,
            )
    return chosen


def role_grid_values(result: AnalysisResult) -> tuple[list[list[float]], list[list[str]]] | None:
    """(scores, abbreviated role names) per layer × head from profile_heads, when it ran."""
    report = result.reports.get("profile_heads")
    heads = getattr(report, "heads", None)
    if not heads:
        return None
    layers, count = result.maps.entropy.shape
    values = [[0.0] * count for _ in range(layers)]
    names = [[""] * count for _ in range(layers)]
    for item in heads:
        if item.primary_role is None:
            continue
        values[item.layer][item.head] = float(item.scores.get(item.primary_role, 0.0))
        names[item.layer][item.head] = ROLE_ABBREVIATIONS.get(item.primary_role, item.primary_role[:3])
    return values, names


def head_descriptions(result: AnalysisResult) -> list[list[str]]:
    """One line per head: its entropy, first-token share, mean max weight and primary role."""
    maps = result.maps
    layers, heads = maps.entropy.shape
    info = [
        [
            f"entropy {maps.entropy[l, h]:.2f} nats ({maps.normalised_entropy[l, h]:.0%} of uniform), "
            f"first-token share {maps.first_token_share[l, h]:.0%}, mean max weight {maps.max_weight[l, h]:.2f}"
            for h in range(heads)
        ]
        for l in range(layers)  # noqa: E741
    ]
    profile = result.reports.get("profile_heads")
    for item in getattr(profile, "heads", None) or []:
        if item.primary_role is not None:
            info[item.layer][item.head] += f"; role: {item.primary_role} ({item.scores[item.primary_role]:.2f})"
    return info


def html_grids(result: AnalysisResult) -> dict[str, dict[str, Any]]:
    """The layer × head grids the page can colour, each with its range and a one-line description."""
    maps = result.maps
    grids: dict[str, dict[str, Any]] = {
        name: {"values": values.tolist(), "min": 0.0, "max": 1.0, "description": description}
        for name, values, description in (
            ("normalised entropy", maps.normalised_entropy, "mean entropy / ln(keys visible)"),
            ("first-token share", maps.first_token_share, "mean attention on position 0"),
            ("mean max weight", maps.max_weight, "mean of each query's largest weight"),
        )
    }
    role_grid = role_grid_values(result)
    if role_grid is not None:
        grids["primary role"] = {
            "values": role_grid[0],
            "labels": role_grid[1],
            "min": 0.0,
            "max": 1.0,
            "description": "score of each head's primary role",
        }
    return grids
