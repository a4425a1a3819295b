"""Prompt segmentation: which token belongs to which part of a prompt (system, user turns, named spans, template).

A prompt is plain text or a list of chat messages rendered with the model's own chat template. Segments come
from the message roles (numbered turns ``system#1``, ``user#1``, ``assistant#1``, ``user#2`` ...), from the
template's own text (``template``: markers, role names, newlines, any default text the template adds) and
from spans the caller names by substring or character span. Tokens are mapped to segments through the
tokenizer's character offsets, so nothing is guessed:

* each message's content is located in the rendered text exactly: the template is rendered once more with a
  unique placeholder per message, which splits it into the template's fixed pieces; the real rendering must
  then be ``piece₀ content₀ piece₁ content₁ … pieceₙ`` (content verbatim, or stripped when the template trims
  it), otherwise the prompt is refused rather than mapped by a guess;
* every character of the rendered text gets one owner (a named span inside a message wins over the message,
  a message over the template), and a token goes to the owner of most of its non-whitespace characters (all
  its characters when it is only whitespace; earlier and more specific owners win ties). Tokens that share
  characters (a multi-byte character split over several byte-level tokens) each count the shared characters.
  Tokens with no characters (a BOS the tokenizer adds) go to ``template`` (chat) or ``special`` (plain text).

Text the chat template adds on its own (a default system prompt when none is given, date lines) is not a marker:
each run of template text is split at the tokenizer's special tokens and line breaks, and a piece holding at
least :data:`INSERTED_MIN_WORDS` words besides role names becomes its own segment, ``inserted#1`` ... (kind
``inserted``), so a report can say the model read text nobody sent. Role and text segments that hold named spans
are marked ``gap``: what is left of them is the unnamed text between the named segments.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import Field

from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.schemas import ROLES, ChatMessage, ToolInput

SegmentKind = Literal[
    "system", "user", "assistant", "text", "named", "inserted", "template", "special", "sink", "generated"
]
# Segments no caller may name: they are made here.
RESERVED_NAMES = ("template", "special", "sink", "generated", "text")
CONTENT_KINDS = frozenset({"system", "user", "assistant", "text", "named", "inserted"})
DROPPABLE_KINDS = frozenset({"template", "special", "text", "inserted"})  # made here, not asked for: dropped when empty
INSERTED_MIN_WORDS = 3  # a piece of template text with this many words besides role names is inserted content
ROLE_WORDS = frozenset({*ROLES, "model", "human", "bot", "ai"})  # role labels templates write around messages
_WORD = re.compile(r"[^\W\d_]+")
_ROLE_LABEL = re.compile(r"([^\W\d_]+)[\s:]+")
MAX_NAMED_SEGMENTS = 16
_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters: never produced by a template, refused in content


class SegmentSpec(ToolInput):
    """A span of the prompt the caller names: a substring (``text``) or a character span (``start``/``end``)."""

    name: str = Field(min_length=1, max_length=40)
    text: str | None = None
    start: int | None = None
    end: int | None = None
    message: int | None = None
    occurrence: int = Field(default=1, ge=1, le=100)


@dataclass(frozen=True)
class CharSpan:
    """A span of the rendered text owned by one segment. ``depth``: 1 message/text, 2 named (inner wins)."""

    name: str
    kind: SegmentKind
    start: int
    end: int
    depth: int = 1
    message: int | None = None


@dataclass(frozen=True)
class Segment:
    name: str
    kind: SegmentKind
    positions: tuple[int, ...]
    message: int | None = None
    char_start: int | None = None
    char_end: int | None = None
    gap: bool = False  # a message or text segment that holds named spans: what is left is the text between them


@dataclass(frozen=True)
class SegmentedPrompt:
    """A tokenised prompt with every token assigned to exactly one segment."""

    encoded: Encoded
    segments: tuple[Segment, ...]
    token_segment: tuple[int, ...]  # segment index of each token
    prompt_format: Literal["text", "messages"]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.segments]

    def index(self, name: str) -> int | None:
        return next((i for i, s in enumerate(self.segments) if s.name == name), None)

    def segment_index(self) -> torch.Tensor:
        """(T,) long: each prompt token's segment."""
        return torch.tensor(self.token_segment, dtype=torch.long)

    def with_sinks(self, positions: Sequence[int]) -> SegmentedPrompt:
        """Move ``positions`` into their own ``sink`` segment (placed first); other segments keep the rest.

        A template, special or plain-text segment left without tokens is dropped; message and named segments
        stay (with no tokens) so that a caller still finds every segment it named.
        """
        if not positions:
            return self
        sink_set = set(positions)
        kept = [Segment("sink", "sink", tuple(sorted(sink_set)))]
        for segment in self.segments:
            rest = tuple(p for p in segment.positions if p not in sink_set)
            if rest or segment.kind not in DROPPABLE_KINDS:
                kept.append(replace(segment, positions=rest))
        owner = {p: index for index, segment in enumerate(kept) for p in segment.positions}
        token_segment = tuple(owner[p] for p in range(len(self.token_segment)))
        return replace(self, segments=tuple(kept), token_segment=token_segment)

    def with_generated(self) -> SegmentedPrompt:
        """Add an empty ``generated`` segment (keys that are tokens the model wrote) to a prompt without one."""
        return replace(self, segments=(*self.segments, Segment("generated", "generated", ())))


# --- token ↔ segment mapping (pure) -----------------------------------------------------------------------------
def assign_tokens(text: str, offsets: Sequence[tuple[int, int]], spans: Sequence[CharSpan]) -> list[int | None]:
    """Each token's owning span (index into ``spans``), or ``None`` for tokens owned by no span.

    Args:
        text: the text the offsets index.
        offsets: (start, end) character offsets per token, as the tokenizer reports them (may overlap).
        spans: character spans; a deeper span wins over a shallower one on the characters both cover. Spans of
            equal depth must not overlap.

    Every character gets one owner (or none); a token goes to the owner of most of its non-whitespace
    characters (of all its characters when it has only whitespace), unowned characters competing as ``None``.
    Ties go to the deeper owner, then to the earlier span. A token with no characters is owned by ``None``.
    """
    owner: list[int | None] = [None] * len(text)
    depth_of: list[int] = [0] * len(text)
    for index, span in enumerate(spans):
        for c in range(max(span.start, 0), min(span.end, len(text))):
            if span.depth > depth_of[c]:
                owner[c], depth_of[c] = index, span.depth
    result: list[int | None] = []
    for start, end in offsets:
        chars = range(max(start, 0), min(end, len(text)))
        if len(chars) == 0:
            result.append(None)
            continue
        solid = [c for c in chars if not text[c].isspace()] or list(chars)
        votes: dict[int | None, int] = {}
        for c in solid:
            votes[owner[c]] = votes.get(owner[c], 0) + 1

        def rank(item: tuple[int | None, int]) -> tuple[int, int, int]:
            who, count = item
            depth = spans[who].depth if who is not None else 0
            return (count, depth, -(who if who is not None else len(spans)))

        result.append(max(votes.items(), key=rank)[0])
    return result


# --- locating messages in the rendered template ----------------------------------------------------------------
def check_messages(messages: Sequence[ChatMessage | dict]) -> list[ChatMessage]:
    """Parse and check a message list: not empty, allowed roles, no placeholder characters."""
    if len(messages) == 0:
        msg = "prompt is an empty message list; give plain text or at least one {role, content} message"
        raise InvalidInputError(msg, field="prompt")
    parsed = []
    for i, message in enumerate(messages):
        role = message.role if isinstance(message, ChatMessage) else message.get("role")
        if role not in ROLES:
            msg = f"message {i} has role {role!r}; allowed roles: {', '.join(ROLES)}"
            raise InvalidInputError(msg, field=f"prompt[{i}].role")
        item = message if isinstance(message, ChatMessage) else ChatMessage.model_validate(message)
        if "\ue000" in item.content or "\ue001" in item.content:
            msg = f"message {i} contains the private-use characters U+E000/U+E001, which are reserved here"
            raise InvalidInputError(msg, field=f"prompt[{i}].content")
        parsed.append(item)
    return parsed


def locate_contents(rendered: str, skeleton: str, contents: Sequence[str]) -> list[tuple[int, int]]:
    """Character span of each message's content in ``rendered``, from the placeholder rendering ``skeleton``.

    ``skeleton`` is the template rendered with ``_PLACEHOLDER.format(i)`` as message i's content. The rendered
    text must be the skeleton's pieces with each content (verbatim or stripped) in place of its placeholder.
    """
    pieces: list[str] = []
    cursor = 0
    for i in range(len(contents)):
        placeholder = _PLACEHOLDER.format(i)
        found = skeleton.find(placeholder, cursor)
        if found < 0:
            msg = f"the chat template does not write message {i}'s content verbatim; its tokens cannot be mapped"
            raise UnsupportedModelError(msg)
        pieces.append(skeleton[cursor:found])
        cursor = found + len(placeholder)
    pieces.append(skeleton[cursor:])
    spans = []
    position = 0
    for i, content in enumerate(contents):
        if not rendered.startswith(pieces[i], position):
            msg = f"the chat template renders the text around message {i} differently with other content"
            raise UnsupportedModelError(msg)
        position += len(pieces[i])
        for written in dict.fromkeys((content, content.strip())):
            if rendered.startswith(written, position) and rendered.startswith(pieces[i + 1], position + len(written)):
                break
        else:
            msg = f"the chat template changes message {i}'s content (not verbatim, not just stripped)"
            raise UnsupportedModelError(msg)
        spans.append((position, position + len(written)))
        position += len(written)
    if rendered[position:] != pieces[-1]:
        raise UnsupportedModelError("the chat template's closing text depends on the messages' content")
    return spans


def role_spans(messages: Sequence[ChatMessage], content_spans: Sequence[tuple[int, int]]) -> list[CharSpan]:
    """One span per message named by role and turn number: system#1, user#1, assistant#1, user#2, ..."""
    counts: dict[str, int] = {}
    spans = []
    for i, (message, (start, end)) in enumerate(zip(messages, content_spans, strict=True)):
        counts[message.role] = counts.get(message.role, 0) + 1
        spans.append(CharSpan(f"{message.role}#{counts[message.role]}", message.role, start, end, 1, i))
    return spans


def uncovered(spans: Sequence[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The runs of [start, end) that none of ``spans`` covers, in order (the spans may overlap)."""
    runs: list[tuple[int, int]] = []
    cursor = start
    for left, right in sorted(spans):
        if left > cursor:
            runs.append((cursor, left))
        cursor = max(cursor, right)
    if cursor < end:
        runs.append((cursor, end))
    return runs


def inserted_spans(
    rendered: str, content_spans: Sequence[tuple[int, int]], markers: Sequence[str]
) -> list[tuple[int, int]]:
    """Character spans of text the chat template writes on its own (not markers, not role names).

    The template's text (everything outside the messages' contents) is split at ``markers`` (the tokenizer's
    special tokens) and at line breaks; a piece with at least :data:`INSERTED_MIN_WORDS` words that are not role
    labels is inserted text. Inserted pieces of one run of template text separated only by whitespace are one span.
    """
    runs = uncovered(content_spans, 0, len(rendered))
    split = "|".join([re.escape(m) for m in sorted(set(markers), key=len, reverse=True) if m] + [r"\n"])
    found: list[tuple[int, int]] = []
    for run_start, run_end in runs:
        pieces: list[tuple[int, int]] = []
        at = run_start
        for match in re.finditer(split, rendered[run_start:run_end]):
            pieces.append((at, run_start + match.start()))
            at = run_start + match.end()
        pieces.append((at, run_end))
        merged: list[tuple[int, int]] = []
        for start, end in pieces:
            text = rendered[start:end]
            words = [w for w in _WORD.findall(text) if w.lower() not in ROLE_WORDS]
            if len(words) < INSERTED_MIN_WORDS:
                continue
            start += len(text) - len(text.lstrip())
            end -= len(text) - len(text.rstrip())
            while (label := _ROLE_LABEL.match(rendered, start, end)) and label.group(1).lower() in ROLE_WORDS:
                start = label.end()  # a role label on the same line ("system You are ...") is the template's
            if merged and not rendered[merged[-1][1] : start].strip():
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        found.extend(merged)
    return found


def template_markers(loaded: LoadedModel) -> list[str]:
    """The tokenizer's special and added tokens' texts: the markers a chat template writes."""
    tokenizer = loaded.tokenizer
    markers = [str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []]
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    markers += [str(getattr(t, "content", t)) for t in added.values()]
    return markers


# --- named spans -------------------------------------------------------------------------------------------------
def _scopes(spec: SegmentSpec, bases: Sequence[tuple[int, int]], text: str, chat: bool) -> list[tuple[int, int, str]]:
    """(start, end, description) of where a named span may lie, in rendered-text coordinates."""
    if spec.message is None:
        if chat:
            return [(s, e, f"message {i}'s content") for i, (s, e) in enumerate(bases)]
        return [(0, len(text), "the text")]
    if not chat:
        msg = f"segment {spec.name!r}: message={spec.message} given but the prompt is plain text; omit message"
        raise InvalidInputError(msg, field="segments")
    if not 0 <= spec.message < len(bases):
        msg = f"segment {spec.name!r}: message {spec.message} out of range 0..{len(bases) - 1}"
        raise InvalidInputError(msg, field="segments")
    start, end = bases[spec.message]
    return [(start, end, f"message {spec.message}'s content")]


def named_span(spec: SegmentSpec, text: str, bases: Sequence[tuple[int, int]], *, chat: bool) -> CharSpan:
    """Resolve one named segment to a span of the rendered text, or a clear error."""
    scopes = _scopes(spec, bases, text, chat)
    has_span = spec.start is not None or spec.end is not None
    if (spec.text is None) == (not has_span) or (has_span and (spec.start is None or spec.end is None)):
        msg = f"segment {spec.name!r}: give either text (a substring) or both start and end (a character span)"
        raise InvalidInputError(msg, field="segments")
    if spec.text is not None:
        if not spec.text.strip():
            raise InvalidInputError(f"segment {spec.name!r}: text is empty or whitespace only", field="segments")
        found: list[int] = []
        for start, end, _ in scopes:
            at = text.find(spec.text, start, end)
            while at >= 0 and at + len(spec.text) <= end:
                found.append(at)
                at = text.find(spec.text, at + 1, end)
        where = scopes[0][2] if len(scopes) == 1 else "any message's content"
        if not found:
            msg = (
                f"segment {spec.name!r}: text {spec.text!r} not found in {where} "
                "(it must appear verbatim, case-sensitive)"
            )
            raise InvalidInputError(msg, field="segments")
        if spec.occurrence > len(found):
            msg = (
                f"segment {spec.name!r}: occurrence {spec.occurrence} out of range 1..{len(found)} "
                f"for text {spec.text!r}"
            )
            raise InvalidInputError(msg, field="segments")
        at = found[spec.occurrence - 1]
        return CharSpan(spec.name, "named", at, at + len(spec.text), 2, _message_at(at, bases) if chat else None)
    assert spec.start is not None and spec.end is not None
    if len(scopes) != 1:
        msg = f"segment {spec.name!r}: a character span in a message list needs message (0..{len(bases) - 1})"
        raise InvalidInputError(msg, field="segments")
    base, stop, where = scopes[0]
    size = stop - base
    if not 0 <= spec.start < spec.end <= size:
        msg = (
            f"segment {spec.name!r}: character span {spec.start}..{spec.end} out of range; {where} is {size} "
            f"characters long (need 0 <= start < end <= {size})"
        )
        raise InvalidInputError(msg, field="segments")
    return CharSpan(spec.name, "named", base + spec.start, base + spec.end, 2, spec.message)


def _message_at(position: int, bases: Sequence[tuple[int, int]]) -> int | None:
    return next((i for i, (s, e) in enumerate(bases) if s <= position < e), None)


def check_named(specs: Sequence[SegmentSpec], auto_names: Sequence[str]) -> None:
    if len(specs) > MAX_NAMED_SEGMENTS:
        msg = f"{len(specs)} named segments; give at most {MAX_NAMED_SEGMENTS}"
        raise InvalidInputError(msg, field="segments")
    seen: set[str] = set()
    for spec in specs:
        name = spec.name.strip()
        if not name or name in RESERVED_NAMES or name in auto_names or "#" in name:
            msg = (
                f"segment name {spec.name!r} is taken or reserved; names may not be empty, contain '#', "
                f"or be one of {', '.join(RESERVED_NAMES)} or an automatic segment ({', '.join(auto_names) or 'none'})"
            )
            raise InvalidInputError(msg, field="segments")
        if name in seen:
            raise InvalidInputError(f"segment name {name!r} given twice; names must be unique", field="segments")
        seen.add(name)


def _check_disjoint(spans: Sequence[CharSpan]) -> None:
    ordered = sorted(spans, key=lambda s: s.start)
    for left, right in itertools.pairwise(ordered):
        if right.start < left.end:
            msg = (
                f"segments {left.name!r} (characters {left.start}..{left.end}) and {right.name!r} "
                f"({right.start}..{right.end}) overlap; named segments must not overlap"
            )
            raise InvalidInputError(msg, field="segments")


# --- the whole prompt --------------------------------------------------------------------------------------------
def segment_prompt(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: str | Sequence[ChatMessage | dict],
    named: Sequence[SegmentSpec] | None = None,
) -> SegmentedPrompt:
    """Render (for messages), tokenise with offsets, and assign every token to one segment."""
    specs = list(named or [])
    if isinstance(prompt, str):
        encoded = inspector.encode(loaded, prompt)
        bases = [(0, len(prompt))]
        spans = [CharSpan("text", "text", 0, len(prompt), 1)]
        fallback = Segment("special", "special", ())
        chat = False
    else:
        messages = check_messages(prompt)
        rendered = inspector.render_messages(loaded, [m.model_dump() for m in messages])
        placeholders = [{"role": m.role, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
        skeleton = inspector.render_messages(loaded, placeholders)
        bases = locate_contents(rendered, skeleton, [m.content for m in messages])
        spans = role_spans(messages, bases)
        inserted = inserted_spans(rendered, bases, template_markers(loaded))
        spans += [CharSpan(f"inserted#{i + 1}", "inserted", a, b, 1) for i, (a, b) in enumerate(inserted)]
        # the template already holds its special tokens: adding the tokenizer's own would double a BOS
        encoded = inspector.encode(loaded, rendered, add_special_tokens=False)
        fallback = Segment("template", "template", ())
        chat = True
    check_named(specs, [s.name for s in spans])
    named_spans = [named_span(spec, encoded.text, bases, chat=chat) for spec in specs]
    _check_disjoint(named_spans)
    holders = {span.message for span in named_spans}  # messages (None: the plain text) that hold named spans
    all_spans = spans + named_spans
    owners = assign_tokens(encoded.text, encoded.offsets, all_spans)
    # segments in order of first appearance: spans by start (the outer first), then the fallback (owner None)
    ordered = sorted(range(len(all_spans)), key=lambda i: (all_spans[i].start, -all_spans[i].depth))
    index_of: dict[int | None, int] = {i: rank for rank, i in enumerate(ordered)}  # owner -> its segment's index
    segments: list[Segment] = []
    for i in ordered:
        span = all_spans[i]
        positions = tuple(p for p, o in enumerate(owners) if o == i)
        if span.kind == "named" and not positions:
            msg = f"segment {span.name!r} (characters {span.start}..{span.end}) covers no whole token; widen it"
            raise InvalidInputError(msg, field="segments")
        gap = span.kind in {*ROLES, "text"} and span.message in holders
        segments.append(Segment(span.name, span.kind, positions, span.message, span.start, span.end, gap))
    fallback_positions = tuple(p for p, o in enumerate(owners) if o is None)
    if fallback_positions:
        index_of[None] = len(segments)
        segments.append(replace(fallback, positions=fallback_positions))
    token_segment = tuple(index_of[o] for o in owners)
    return SegmentedPrompt(encoded, tuple(segments), token_segment, "messages" if chat else "text")
