"""patch_heads' passes: a recorded clean run, the corrupted run, then batched patched runs of the corrupted prompt.

Every head's (and every layer's) patch is one row of a batch; rows are grouped by layer, so the layers before the
patched one run once per group (:mod:`agent_tools.runner.patching`). The top heads are then patched one position at
a time, from the first position where the prompts differ (before it the clean and corrupted head outputs are the
same, so a patch there restores exactly nothing). Every forward goes through the inspector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_tools.analysis.attribution import restored_fraction
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_trace import NextCall
from agent_tools.runner.patching import HeadPatch
from agent_tools.schemas import head_label, rounded
from agent_tools.tools.patch_heads.models import (
    HeadPatchResult,
    HeadPositions,
    LayerPatchResult,
    PatchHeadsInput,
    PatchReport,
    PositionPatch,
)
from agent_tools.tools.patch_heads.narrative import Patched, findings, summary

MIN_LOGIT_GAP = 1e-4  # clean and corrupted logit differences closer than this leave nothing to restore


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


def _encode_pair(inspector: Inspector, loaded: LoadedModel, args: PatchHeadsInput) -> tuple[Encoded, Encoded]:
    """Both prompts, tokenised; they must be the same length and differ somewhere."""
    clean, corrupted = inspector.encode(loaded, args.clean), inspector.encode(loaded, args.corrupted)
    if clean.length != corrupted.length:
        msg = (
            f"clean is {clean.length} tokens and corrupted is {corrupted.length} tokens; patching copies head outputs "
            "position by position, so both prompts must have the same number of tokens: change words for words of "
            "the same token count (e.g. one one-token name for another) or add/remove words in one of them"
        )
        raise InvalidInputError(msg, field="corrupted")
    if torch.equal(clean.input_ids, corrupted.input_ids):
        msg = "clean and corrupted are the same tokens; change the information the answer depends on in corrupted"
        raise InvalidInputError(msg, field="corrupted")
    if clean.length < 2:
        msg = "the prompts are 1 token; give at least 2 so heads have something to read"
        raise InvalidInputError(msg, field="clean")
    return clean, corrupted


def _answer_ids(loaded: LoadedModel, args: PatchHeadsInput, clean: torch.Tensor, corrupted: torch.Tensor) -> tuple:
    """(answer, wrong) token ids: given, or the two prompts' top next tokens (which must differ)."""
    answer = single_token(loaded, args.answer, "answer") if args.answer is not None else int(clean.argmax())
    wrong = single_token(loaded, args.wrong, "wrong") if args.wrong is not None else int(corrupted.argmax())
    if answer == wrong:
        shown = str(loaded.tokenizer.decode([answer]))
        msg = (
            f"answer and wrong are the same token {shown!r}; give two different one-token answers (answer for the "
            "clean prompt, wrong for the corrupted one)"
        )
        raise InvalidInputError(msg, field="wrong" if args.wrong is not None else "answer")
    return answer, wrong


def _differences(outputs: torch.Tensor, answer: int, wrong: int) -> torch.Tensor:
    """(R, 1, V) last-position logits -> (R,) logit(answer) − logit(wrong)."""
    return (outputs[:, -1, answer] - outputs[:, -1, wrong]).double()


@dataclass(frozen=True)
class _Pair:
    """The two prompts, where they first differ, the answer tokens and the logit differences to restore."""

    clean: Encoded
    corrupted: Encoded
    first: int
    answer: int
    wrong: int
    ld_clean: float
    ld_corrupted: float
    sources: dict[int, torch.Tensor]  # the clean run's head outputs, layer -> (T, H, D)

    def restored(self, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, 1, V) patched logits -> (R,) restored fractions, (R,) logit differences."""
        differences = _differences(outputs, self.answer, self.wrong)
        return restored_fraction(differences, self.ld_clean, self.ld_corrupted), differences


def _pair(inspector: Inspector, loaded: LoadedModel, args: PatchHeadsInput) -> _Pair:
    """Encode and check both prompts, run them, and resolve the answer tokens; refuse a pair with nothing to restore."""
    clean, corrupted = _encode_pair(inspector, loaded, args)
    recorded = inspector.recorded_run(loaded, clean)
    corrupted_logits = inspector.recorded_run(loaded, corrupted).output
    answer, wrong = _answer_ids(loaded, args, recorded.output[-1], corrupted_logits[-1])
    ld_clean = float(_differences(recorded.output[None], answer, wrong)[0])
    ld_corrupted = float(_differences(corrupted_logits[None], answer, wrong)[0])
    if abs(ld_clean - ld_corrupted) < MIN_LOGIT_GAP:
        msg = (
            f"clean and corrupted give the same logit difference ({ld_clean:.4g}) between the two answers: nothing "
            "to restore; corrupt the information the answer depends on, or choose answer/wrong tokens that differ"
        )
        raise InvalidInputError(msg, field="corrupted")
    first = int((clean.input_ids[0] != corrupted.input_ids[0]).nonzero()[0])
    return _Pair(clean, corrupted, first, answer, wrong, ld_clean, ld_corrupted, recorded.heads)


def _patch_every_head(
    inspector: Inspector, loaded: LoadedModel, pair: _Pair, layers: list[int]
) -> tuple[list[HeadPatchResult], list[LayerPatchResult]]:
    """Every head of ``layers`` patched alone, and every layer's heads together: one batched row each."""
    count = loaded.facts.num_heads
    heads = [HeadPatch(layer, (head,)) for layer in layers for head in range(count)]
    whole = [HeadPatch(layer, tuple(range(count))) for layer in layers]
    outputs = inspector.patched_outputs(loaded, pair.corrupted, heads + whole, sources=pair.sources, prefix=pair.first)
    fractions, differences = pair.restored(outputs)
    head_rows = [
        HeadPatchResult(layer=p.layer, head=p.heads[0], restored=rounded(float(f)), logit_difference=rounded(float(d)))
        for p, f, d in zip(heads, fractions[: len(heads)], differences[: len(heads)], strict=True)
    ]
    layer_rows = [
        LayerPatchResult(layer=p.layer, restored=rounded(float(f)))
        for p, f in zip(whole, fractions[len(heads) :], strict=True)
    ]
    return head_rows, layer_rows


STACK_REFUSAL = (
    "patch_heads copies head outputs between two runs of a decoder-only language model and reads the next-token "
    "logits; an encoder–decoder's logits come from its decoder reading the encoder, which this tool does not patch"
)


def patch_heads(inspector: Inspector, args: PatchHeadsInput) -> PatchReport:
    """Patch every head's clean output into the corrupted run; the fraction of the logit difference it restores."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self",), STACK_REFUSAL)
    if not loaded.facts.is_language_model:
        raise InvalidInputError(f"model {loaded.name!r} has no next-token head; patch_heads needs a language model")
    layers = inspector.check_layers(loaded, args.layers, stack, "layers")
    pair = _pair(inspector, loaded, args)
    head_rows, layer_rows = _patch_every_head(inspector, loaded, pair, layers)
    top = sorted(head_rows, key=lambda r: -abs(r.restored))[: args.top_k]
    positions = _positions(inspector, loaded, pair, top) if args.per_position else []
    numbers = Patched(
        answer=str(loaded.tokenizer.decode([pair.answer])),
        wrong=str(loaded.tokenizer.decode([pair.wrong])),
        clean=pair.ld_clean,
        corrupted=pair.ld_corrupted,
        heads=len(head_rows),
        top=top,
        layers=layer_rows,
        positions=positions,
    )
    differing = (pair.clean.input_ids[0] != pair.corrupted.input_ids[0]).nonzero().flatten().tolist()
    return PatchReport(
        model=loaded.name,
        summary=summary(numbers),
        findings=findings(numbers),
        tokens=pair.clean.length,
        first_difference=pair.first,
        differing_positions=differing,
        answer=numbers.answer,
        answer_id=pair.answer,
        wrong=numbers.wrong,
        wrong_id=pair.wrong,
        logit_difference_clean=rounded(pair.ld_clean),
        logit_difference_corrupted=rounded(pair.ld_corrupted),
        direction="the clean run's head outputs copied into the corrupted run (denoising)",
        layers=layers,
        top_heads=top,
        heads=head_rows,
        layer_results=layer_rows,
        positions=positions,
        patched_runs=len(head_rows) + len(layer_rows) + len(top) * (pair.clean.length - pair.first) * bool(positions),
        next_calls=_next_calls(loaded, args, top),
    )


def _positions(inspector: Inspector, loaded: LoadedModel, pair: _Pair, top: list[HeadPatchResult]) -> list:
    """Each top head patched at one position at a time, from the first differing position on (one batch)."""
    corrupted, first = pair.corrupted, pair.first
    span = range(first, corrupted.length)
    patches = [HeadPatch(r.layer, (r.head,), (p,)) for r in top for p in span]
    outputs = inspector.patched_outputs(loaded, corrupted, patches, sources=pair.sources, prefix=first)
    fractions = pair.restored(outputs)[0].reshape(len(top), len(span))
    return [
        HeadPositions(
            layer=r.layer,
            head=r.head,
            positions=[
                PositionPatch(
                    position=p,
                    token=corrupted.tokens[p].text,
                    restored=rounded(float(fractions[k, p - first])) if p >= first else 0.0,
                )
                for p in range(corrupted.length)
            ],
        )
        for k, r in enumerate(top)
    ]


def _next_calls(loaded: LoadedModel, args: PatchHeadsInput, top: list[HeadPatchResult]) -> list[NextCall]:
    """Ablate the top heads on the clean prompt (do they matter there?) and profile their layers (what are they?)."""
    labels = [head_label(r.layer, r.head) for r in top]
    layers = sorted({r.layer for r in top})
    return [
        NextCall(
            tool="ablate_heads",
            arguments={"model": loaded.name, "text": args.clean, "heads": labels},
            why="removing the heads that restore most should break the clean answer if they carry it; the report "
            "also gives each head's direct logit attribution",
        ),
        NextCall(
            tool="profile_heads",
            arguments={"model": loaded.name, "text": args.clean, "layers": layers},
            why="the roles of the top heads (previous-token, induction, ...) with ablation evidence",
        ),
    ]
