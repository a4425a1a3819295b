"""Phrases several tools' sentences write the same way: a signed change, a head's name, short lists, the score
scale against 1/sqrt(d_k), the random-head baseline; and the sample text a next call suggests.

Base layer: pure string functions of plain values (no torch, no pydantic), so every narrative can use them.
"""

from __future__ import annotations

from collections.abc import Sequence

SAMPLE_TEXT = "The cat sat on the mat because it was tired."  # a next call's text for a first look, when none was given


def signed(value: float) -> str:
    """``+0.12``, ``-0.03``: a change to two decimals with its sign, never ``-0.00``."""
    return f"{round(value, 2) + 0.0:+.2f}"  # + 0.0 turns -0.0 into 0.0


def head_name(layer: int, head: int) -> str:
    """``L3H0``: a head as sentences name it (an argument takes ``3.0``, :func:`agent_tools.schemas.head_label`)."""
    return f"L{layer}H{head}"


def listed(items: Sequence[str], shown: int | None = None) -> str:
    """The items, comma-separated: the first ``shown`` (None: all), then how many more."""
    if shown is None or len(items) <= shown:
        return ", ".join(items)
    return ", ".join(items[:shown]) + f" and {len(items) - shown} more"


def head_names(labels: Sequence[str], shown: int | None = None) -> str:
    """``"layer.head"`` labels as ``L1H0, L2H3`` (the first ``shown``, then how many more)."""
    return listed(["L" + label.replace(".", "H") for label in labels], shown)


STANDARD_SCALE_TOLERANCE = 1e-3  # |scaling · sqrt(d_k) − 1| within this counts as the standard 1/sqrt(d_k)


def is_standard_scale(ratio: float) -> bool:
    """Whether a factor on q·k, given as ``ratio`` = scaling · sqrt(d_k), is the textbook 1/sqrt(d_k)."""
    return abs(ratio - 1) <= STANDARD_SCALE_TOLERANCE


def scale_phrase(ratio: float) -> str:
    """``= 1/sqrt(d_k)``, or ``1.41× 1/sqrt(d_k)``: a factor on q·k against the textbook one."""
    return "= 1/sqrt(d_k)" if is_standard_scale(ratio) else f"{ratio:.3g}× 1/sqrt(d_k)"


def random_heads(draws: int, per_draw: int) -> str:
    """``8 random heads``, or ``8 random sets of 3 heads``: what a baseline removed or patched."""
    return f"{draws} random " + ("heads" if per_draw == 1 else f"sets of {per_draw} heads")
