"""A clean/corrupted prompt pair and its two answer tokens, validated once for every tool that patches between them
(patch_heads, find_circuit): same token length, different tokens, one-token answers that differ.

Service layer (below the tools, which never import each other): it uses the inspector to tokenise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_tools.analysis.attribution import restored_fraction
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel

EXAMPLE = {  # both tools' example: one word changed that the answer depends on
    "clean": "the cat sat on the mat. the cat sat on the",
    "corrupted": "the cat sat on the rug. the cat sat on the",
    "answer": " mat",
    "wrong": " rug",
}


def single_token(loaded: LoadedModel, text: str, field: str) -> int:
    """The one token id of ``text`` as it follows a prompt, or an error naming the tokens it splits into."""
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [str(loaded.tokenizer.decode([i])) for i in ids]
        msg = (
            f"{field} {text!r} is {len(ids)} tokens ({pieces}) for {loaded.name!r}; give exactly one token as it "
            "follows the prompt (mind the leading space, e.g. ' Mary')"
        )
        raise InvalidInputError(msg, field=field)
    return int(ids[0])


def encode_pair(inspector: Inspector, loaded: LoadedModel, clean: str, corrupted: str) -> tuple[Encoded, Encoded]:
    """Both prompts, tokenised; they must be the same length and differ somewhere."""
    first, second = inspector.encode(loaded, clean), inspector.encode(loaded, corrupted)
    if first.length != second.length:
        msg = (
            f"clean is {first.length} tokens and corrupted is {second.length} tokens; patching copies activations "
            "position by position, so both prompts must have the same number of tokens: change words for words of "
            "the same token count (e.g. one one-token name for another) or add/remove words in one of them"
        )
        raise InvalidInputError(msg, field="corrupted")
    if torch.equal(first.input_ids, second.input_ids):
        msg = "clean and corrupted are the same tokens; change the information the answer depends on in corrupted"
        raise InvalidInputError(msg, field="corrupted")
    if first.length < 2:
        msg = "the prompts are 1 token; give at least 2 so heads have something to read"
        raise InvalidInputError(msg, field="clean")
    inspector.explains(loaded, first)  # the report's path gap is the clean prompt's
    return first, second


def answer_ids(
    loaded: LoadedModel, answer: str | None, wrong: str | None, clean: torch.Tensor, corrupted: torch.Tensor
) -> tuple[int, int]:
    """(answer, wrong) token ids: given, or the two prompts' top next tokens ((V,) logits; they must differ)."""
    first = single_token(loaded, answer, "answer") if answer is not None else int(clean.argmax())
    second = single_token(loaded, wrong, "wrong") if wrong is not None else int(corrupted.argmax())
    if first == second:
        shown = str(loaded.tokenizer.decode([first]))
        msg = (
            f"answer and wrong are the same token {shown!r}; give two different one-token answers (answer for the "
            "clean prompt, wrong for the corrupted one)"
        )
        raise InvalidInputError(msg, field="wrong" if wrong is not None else "answer")
    return first, second


@dataclass
class LogitDifference:
    """The metric both tools' gradient passes read: (clean (V,), logits (B, V)) last-position logits -> (B,)
    logit(answer) − logit(wrong); the two tokens are resolved on the first call (:func:`answer_ids`, from the clean
    run's logits and the first row's) and kept in ``tokens``."""

    loaded: LoadedModel
    answer: str | None
    wrong: str | None
    tokens: tuple[int, int] | None = None

    def __call__(self, clean: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.tokens is None:
            self.tokens = answer_ids(self.loaded, self.answer, self.wrong, clean, logits[0].detach())
        return logits[:, self.tokens[0]] - logits[:, self.tokens[1]]


def restored(chosen: torch.Tensor, clean: float, corrupted: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, k) logits of (answer, wrong, ...) that patched rows kept, and the clean and corrupted logit differences ->
    (R,) restored fractions and (R,) logit differences, float64 on the CPU."""
    differences = (chosen[:, 0] - chosen[:, 1]).cpu().double()  # (R,) logit(answer) − logit(wrong): one copy
    return restored_fraction(differences, clean, corrupted), differences


def first_difference(clean: Encoded, corrupted: Encoded) -> int:
    """The first position where the two prompts' tokens differ."""
    return int((clean.input_ids[0] != corrupted.input_ids[0]).nonzero()[0])
