"""The report's glossary: every unit and metric it uses, one line each, with its formula.

The attention metrics are not written twice: their formulas and ranges are read from the table in
:mod:`agent_tools.analysis.metrics`' docstring (the project's metric glossary), by column. What that table does
not hold — units, the scale, the softmax Jacobian, the value-side norms, the Zhai bound, effective rank, the
training curves — is defined here, next to the constants the tools use. Each term carries the phrases that link
to it: the HTML page turns the first occurrence of each in a paragraph into a link to its line.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from agent_tools.analysis import metrics
from agent_tools.analysis.collapse import NO_OP_CONTRIBUTION
from agent_tools.analysis.metrics import SATURATION
from agent_tools.tools.inspect_projections.models import EFFECTIVE_RANK_DEFINITION


@dataclass(frozen=True)
class Term:
    """One glossary line: ``name`` = ``formula``, what it tells the reader, and the phrases linking to it."""

    key: str  # the anchor: ``#g-<key>``
    name: str
    formula: str
    meaning: str
    phrases: tuple[str, ...] = ()  # exact phrases (case-sensitive) that link here; ``name`` always does

    @property
    def anchor(self) -> str:
        return f"g-{self.key}"

    def as_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "anchor": self.anchor,
            "name": self.name,
            "formula": self.formula,
            "meaning": self.meaning,
            "phrases": [self.name, *self.phrases],
        }


@cache
def metric_table() -> dict[str, tuple[str, str]]:
    """name -> (formula, range) from the table in :mod:`agent_tools.analysis.metrics`' docstring.

    Columns are cut where the table's ``----`` rule puts them; "used by" lines are skipped.
    """
    lines = (metrics.__doc__ or "").splitlines()
    rule = next((i for i, line in enumerate(lines) if line.strip().startswith("----")), None)
    if rule is None:
        return {}
    starts = [i for i, c in enumerate(lines[rule]) if c == "-" and (i == 0 or lines[rule][i - 1] == " ")]
    table: dict[str, tuple[str, str]] = {}
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        name = line[starts[0] : starts[1]].strip()
        if name:
            table[name] = (line[starts[1] : starts[2]].strip(), line[starts[2] :].strip())
    return table


def _metric(key: str, name: str, metric: str, meaning: str, *phrases: str) -> Term:
    """A term whose formula (and range) comes from the metrics table."""
    formula, value_range = metric_table().get(metric, ("see agent_tools.analysis.metrics", ""))
    shown = f"{formula}, in {value_range}" if value_range.startswith("[") else formula
    return Term(key, name, shown, meaning, phrases)


# (key, name, the metrics-table row it reads, what it tells the reader, phrases linking to it)
METRIC_TERMS: tuple[tuple[str, ...], ...] = (
    ("entropy", "entropy", "attention_entropy",
     "how spread a query's weights are: 0 = all on one key, ln n = even over n keys", "mean entropy",
     "attention entropy"),
    ("normalised-entropy", "normalised entropy", "normalised_entropy",
     "entropy as a share of the most it could be: 0 = one key, 1 = uniform (comparable across lengths)",
     "% of uniform", "of uniform"),
    ("max-weight", "max weight", "max_weight",
     "the largest weight in a query's row; near 1 the query reads one key only", "mean max weight", "mean max"),
    ("first-token-share", "first-token share", "first_token_share",
     "how much weight lands on position 0 (the usual attention sink)", "sink share"),
    ("sink-fraction", "sink fraction", "sink_row_fraction",
     "how many queries put their largest weight on the first token or a special token"),
    ("js", "JS divergence", "js_divergence",
     "how different two attention rows are: 0 = identical, ln 2 ≈ 0.693 nats = no key in common", "Jensen–Shannon",
     "JS"),
    ("kl", "KL divergence", "kl_divergence", "how far one distribution is from another, in nats", "KL"),
    ("loss", "next-token loss", "next_token_losses",
     "how surprised the model is by the next token; lower = better predicted", "loss"),
    ("softmax", "masked softmax", "masked_softmax",
     "turns scores into weights that sum to 1 over the keys a query may read; hidden keys get exactly 0", "softmax",
     "masked"),
)  # fmt: skip


# (key, name, formula, what it tells the reader, phrases linking to it): the terms the metrics table does not hold,
# in reading order (the metric terms follow the first, nats)
TERMS: tuple[tuple[str, ...], ...] = (
    ("nats", "nats", "natural-log units: ln 2 ≈ 0.693 nats = 1 bit", "the unit of entropy, KL and JS"),
    ("dk", "d_k", "the number of dimensions of one head's q and k (head_dim)",
     "q·k sums d_k products, so its spread grows with d_k", "head_dim"),
    ("scale", "scale 1/sqrt(d_k)", "scores = q·k × β, β = 1/sqrt(d_k) in the standard Transformer",
     "brings Var(q·k) back to about 1 so the softmax stays soft", "1/sqrt(d_k)", "÷sqrt(d_k)", "÷ sqrt(d_k)", "β"),
    ("temperature", "temperature τ", "logits divided by τ: β = model scale / τ",
     "τ > 1 softens the weights, τ < 1 sharpens them; the sweep varies it", "temperature", "τ"),
    ("variance", "Var(q·k)", "measured variance of q·k over (query, visible key) pairs; predicted var(q)·var(k)·d_k",
     "≈ d_k for unit-variance q and k: the reason for the 1/sqrt(d_k) factor", "var(q)·var(k)·d_k", "variance"),
    ("saturated", "saturated row", f"a query whose max weight ≥ {SATURATION}",
     "the softmax has picked one key; its gradient is almost 0", "saturated", "saturate"),
    ("jacobian", "softmax Jacobian trace", "tr(diag(p) − p pᵀ) = 1 − Σ p²; ‖J‖_F = sqrt(Σp² − 2Σp³ + (Σp²)²)",
     "how much gradient the softmax passes back: 0 when saturated, up to 1 − 1/n when even", "Jacobian trace",
     "Jacobian", "‖J‖_F"),
    ("entropy-derivative", "dH/dβ", "dH/dβ = −β·Var_p(z) ≤ 0 for p = softmax(β z)",
     "entropy can only fall as the scale grows"),
    ("value-norm", "‖α·v W_O‖",
     "‖α_ij · v_j W_O^h‖ (Kobayashi et al. 2020): the norm of what key j actually writes into the output",
     "weight alone is not effect: a key with a tiny value writes nothing however much weight it gets", "‖v W_O‖",
     "value norm", "value-norm"),
    ("contribution-ratio", "contribution ratio",
     "mean_i ‖α_ij v_j W_O‖ of the dominant key / mean ‖v_k W_O‖ of the other keys",
     f"below {NO_OP_CONTRIBUTION} the head is a no-op sink; above, a collapse that writes about the same "
     "vector everywhere (value norms only: whether it matters is the ablation check's answer)"),
    ("no-op-sink", "no-op sink",
     f"concentrated on the first/special token with contribution ratio < {NO_OP_CONTRIBUTION}",
     "a head parking its weight where nothing is written: 'nothing to add here', harmless", "no-op", "sinks", "sink"),
    ("writing-collapse", "writing collapse",
     f"concentrated on one key whatever the query, contribution ratio ≥ {NO_OP_CONTRIBUTION}",
     "the head writes about the same vector at every position (value side only; see constant-output)",
     "writing_collapse"),
    ("constant-output", "constant-output head",
     "collapsed, and replacing its output by its mean over positions (mean-ablation) or by its output on "
     "another text (resample-ablation) changes next-token loss no more than removing random heads",
     "a large but input-independent write: a learned bias, not a failure", "constant-output"),
    ("load-bearing", "load-bearing head",
     "removing the head raises next-token loss beyond the random-head baseline's spread",
     "the model uses what the head writes", "load-bearing"),
    ("harmful", "harmful collapse",
     "removing the collapsed head lowers next-token loss beyond the random-head baseline's spread",
     "the collapse makes predictions worse (measured, never read off value norms)", "harmfully", "harmful"),
    ("zhai", "Zhai bound",
     "H(softmax z) ≥ ln(1 + (T−1)η) + r·sqrt(T(T−1))·η / (1 + (T−1)η), η = exp(−r·sqrt(T/(T−1))), "
     "r = ‖z − mean z‖",
     "a row can collapse (entropy near 0) only when its scores spread widely (large r)", "Zhai", "centred score norm"),
    ("effective-rank", "effective rank", EFFECTIVE_RANK_DEFINITION.split(";")[0],
     "how many directions a projection really uses (of d_k possible)", "effective ranks", "stable_rank"),
    ("principal-angles", "principal angles",
     "angles between the subspaces W_Q and W_K read from x; mean cos² = 1 same, 0 orthogonal",
     "low mean cos² (near the random value) = 'what I look for' differs from 'what I offer'", "mean cos²", "cos²"),
    ("top-key-agreement", "top-key agreement", "share of queries whose most-weighted key is the same in two maps",
     "1 = the two maps pick the same key for every query", "same top key"),
    ("self-share", "self-share", "mean_i A_ii: the weight a query puts on itself",
     "high for raw x·xᵀ, where every token resembles itself most", "attend mostly to themselves"),
    ("role-score", "role score",
     "the share of attention a head's pattern receives, e.g. previous-token = mean_i A[i, i−1]",
     "in [0, 1]; a head 'has' a role when its score reaches the role's threshold", "primary role"),
    ("induction", "induction head", "on [BOS] r₁…r_N r₁…r_N: mean over second-copy queries of A[i, i−N+1]",
     "finds the earlier occurrence of the current token and reads what came next: copying", "induction"),
    ("probe", "probe", "[BOS] + N random tokens + the same N again (seeded)",
     "random tokens leave copying as the only way to predict the second copy"),
    ("grad-norm", "‖∂L/∂W_q‖", "Frobenius norm of the loss gradient with respect to W_q at a training step",
     "how hard training pushes the query projection; near 0 = learning has stalled", "gradient"),
    ("chance-loss", "chance loss", "ln(labels): the cross-entropy of a uniform guess",
     "a model that knows nothing scores this; above it, the model is confidently wrong"),
    ("accuracy", "accuracy", "share of examples whose most likely label is the right one",
     "1 = always right; 1/labels = guessing"),
)  # fmt: skip


@cache
def glossary() -> tuple[Term, ...]:
    """Every term the report uses, in reading order."""
    plain = [Term(key, name, formula, meaning, tuple(phrases)) for key, name, formula, meaning, *phrases in TERMS]
    return (plain[0], *(_metric(*row) for row in METRIC_TERMS), *plain[1:])


def terms_in(text: str) -> list[Term]:
    """The terms whose name or phrases occur in ``text`` (for a report's own short glossary)."""
    return [t for t in glossary() if any(p in text for p in (t.name, *t.phrases))]
