"""Prompt segmentation against hand-built token offsets (chat markers, multi-byte characters, overlapping
offsets), exact location of message contents in a rendered template, the pure share functions on hand-computed
values, and the real SmolLM2 tokenizer with é, 日本 and an emoji."""

from __future__ import annotations

import math

import pytest
import torch

from agent_tools.analysis.metrics import Received, kl_divergence, received_attention, without_sink
from agent_tools.analysis.metrics import threshold_sinks as find_sinks
from agent_tools.analysis.segments import (
    leading_segment,
    segment_shares,
    share_changes,
    top_positions,
)
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.inspector import Inspector
from agent_tools.prompt_segments import (
    CharSpan,
    SegmentSpec,
    assign_tokens,
    check_messages,
    locate_contents,
    segment_prompt,
)

# A rendered chat, written out by hand: <s>/</s> play the template's special markers.
CHAT = "<s>sys\nCafé 日本🙂</s><s>user\nHi?</s><s>asst\n"
# Offsets as a byte-level BPE reports them: "日" and "🙂" are split over tokens that share their character.
OFFSETS = [
    (0, 3),  # 0 <s>
    (3, 6),  # 1 sys
    (6, 7),  # 2 \n
    (7, 10),  # 3 Caf
    (10, 11),  # 4 é
    (11, 13),  # 5 " 日" (space + first bytes of 日)
    (12, 13),  # 6 last byte of 日 (shares the character with 5)
    (13, 14),  # 7 本
    (14, 15),  # 8 first bytes of 🙂
    (14, 15),  # 9 last bytes of 🙂 (same character)
    (15, 19),  # 10 </s>
    (19, 22),  # 11 <s>
    (22, 26),  # 12 user
    (26, 28),  # 13 "\nH": straddles the template's newline and the content
    (28, 30),  # 14 i?
    (30, 34),  # 15 </s>
    (34, 37),  # 16 <s>
    (37, 41),  # 17 asst
    (41, 42),  # 18 \n
    (42, 42),  # 19 a token with no characters (e.g. an EOS the tokenizer appends)
]
SYSTEM = CharSpan("system#1", "system", 7, 15, 1, 0)
USER = CharSpan("user#1", "user", 27, 30, 1, 1)


def test_hand_built_offsets_are_what_they_claim() -> None:
    assert len(CHAT) == 42
    assert CHAT[7:15] == "Café 日本🙂" and CHAT[27:30] == "Hi?"
    assert CHAT[12] == "日" and CHAT[14] == "🙂" and CHAT[10] == "é"


def test_chat_tokens_map_to_roles_and_template() -> None:
    owners = assign_tokens(CHAT, OFFSETS, [SYSTEM, USER])
    expected = [None, None, None, 0, 0, 0, 0, 0, 0, 0, None, None, None, 1, 1, None, None, None, None, None]
    assert owners == expected


def test_named_span_inside_a_message_takes_split_multibyte_tokens() -> None:
    kanji = CharSpan("kanji", "named", 12, 14, 2, 0)  # "日本"
    owners = assign_tokens(CHAT, OFFSETS, [SYSTEM, USER, kanji])
    # token 5 " 日" counts only its non-space character, which is the named span's
    assert owners[3:10] == [0, 0, 2, 2, 2, 0, 0]
    accent = CharSpan("accent", "named", 10, 11, 2, 0)
    assert assign_tokens(CHAT, OFFSETS, [SYSTEM, USER, accent])[3:5] == [0, 2]
    emoji = CharSpan("emoji", "named", 14, 15, 2, 0)
    assert assign_tokens(CHAT, OFFSETS, [SYSTEM, USER, emoji])[8:10] == [2, 2]


def test_ties_go_to_the_deeper_then_the_earlier_owner() -> None:
    text = "ab cd"
    left, right = CharSpan("x", "named", 0, 1, 2), CharSpan("y", "named", 1, 2, 2)
    assert assign_tokens(text, [(0, 2)], [left, right]) == [0]  # one character each: the earlier wins
    outer = CharSpan("text", "text", 0, 5, 1)
    inner = CharSpan("n", "named", 3, 4, 2)
    assert assign_tokens(text, [(2, 4), (3, 5)], [outer, inner]) == [1, 1]  # "c" named vs " "; "c" vs "d" tie
    assert assign_tokens(text, [(2, 3)], [outer]) == [0]  # whitespace-only token: counted on all characters


def test_locate_contents_is_exact_even_when_content_repeats_template_text() -> None:
    skeleton = "<s>user\n\ue0000\ue001</s>\n<s>assistant\n"
    rendered = "<s>user\nuser</s>\n<s>assistant\n"
    # a search for "user" would find the role marker at 3; the skeleton says the content starts at 8
    assert locate_contents(rendered, skeleton, ["user"]) == [(8, 12)]
    trimmed_skeleton = "[\ue0000\ue001][\ue0001\ue001]"
    assert locate_contents("[hi][there]", trimmed_skeleton, [" hi ", "there"]) == [(1, 3), (5, 10)]
    with pytest.raises(UnsupportedModelError, match="changes message 0"):
        locate_contents("[HI][there]", trimmed_skeleton, ["hi", "there"])
    with pytest.raises(UnsupportedModelError, match="verbatim"):
        locate_contents("[hi]", "[]", ["hi"])


def test_message_checks() -> None:
    with pytest.raises(InvalidInputError, match="empty message list"):
        check_messages([])
    with pytest.raises(InvalidInputError, match=r"role 'tool'; allowed roles: system, user, assistant"):
        check_messages([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}])
    with pytest.raises(InvalidInputError, match="reserved"):
        check_messages([{"role": "user", "content": "a\ue000b"}])


# --- pure share functions ------------------------------------------------------------------------------------
def test_segment_shares_hand_computed() -> None:
    weights = torch.tensor([[0.5, 0.1, 0.2, 0.2], [0.0, 0.0, 0.0, 1.0]])  # (2 heads, 4 keys)
    index = torch.tensor([0, 1, 1, 2])
    shares = segment_shares(weights, index, 4)
    assert torch.allclose(shares, torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    assert torch.equal(weights, torch.tensor([[0.5, 0.1, 0.2, 0.2], [0.0, 0.0, 0.0, 1.0]]))  # not modified
    with pytest.raises(ValueError, match="keys"):
        segment_shares(weights, torch.tensor([0, 1]), 2)


def test_received_attention_excludes_self_and_masked() -> None:
    # one head, causal 3×3 map
    weights = torch.tensor([[[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.5, 0.2, 0.3]]])
    allowed = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
    received = received_attention(weights, allowed, torch.arange(3))
    assert torch.allclose(received.total, torch.tensor([1.1, 0.2, 0.0]))  # key 0 from rows 1, 2; key 1 from row 2
    assert torch.equal(received.count, torch.tensor([2, 1, 0])) and torch.equal(received.readers, received.count)
    assert torch.allclose(received.uniform, torch.tensor([1 / 2 + 1 / 3, 1 / 3, 0.0]))  # rows see 2 and 3 keys
    twice = received + received
    assert torch.allclose(twice.total, 2 * received.total) and torch.equal(twice.readers, 2 * received.readers)
    # a KV-cache step: one query at position 3 reading 4 keys
    step = received_attention(
        torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]), torch.ones(1, 4, dtype=torch.bool), torch.tensor([3])
    )
    assert torch.allclose(step.total, torch.tensor([0.1, 0.2, 0.3, 0.0]))
    assert torch.equal(step.count, torch.tensor([1, 1, 1, 0]))


def test_find_sinks_needs_readers_share_and_excess_over_uniform() -> None:
    def received(mean, uniform, readers):  # per-token means -> sums over one (head, row) pair per reader
        readers = torch.tensor(readers, dtype=torch.float)
        return Received(torch.tensor(mean) * readers, readers, torch.tensor(uniform) * readers, readers)

    # token 1: heavy, many readers, 10× uniform -> sink; 2: heavy but only 2 readers; 3: heavy but only 1.33×
    # uniform (as in a short text); 4: light
    stats = received([0.5, 0.3, 0.4, 0.2, 0.02], [0.05, 0.03, 0.05, 0.15, 0.03], [9, 8, 2, 6, 5])
    assert find_sinks(stats, threshold=0.1) == [0, 1]
    assert find_sinks(stats, threshold=0.1, min_ratio=1.3) == [0, 1, 3]
    assert find_sinks(stats, threshold=0.1, min_readers=2) == [0, 1, 2]
    assert find_sinks(stats, threshold=0.35) == [0]  # position 0 always
    assert find_sinks(stats, threshold=0.35, always=()) == [0]  # it is heavy anyway
    assert find_sinks(stats, threshold=0.6, always=()) == []


def test_leading_segment_margin_and_without_sink() -> None:
    shares = torch.tensor([0.4, 0.25, 0.1, 0.25])
    lead = leading_segment(shares, torch.tensor([False, True, True, True]))
    assert (lead.best, lead.runner_up) == (1, 3)  # ties: the earlier segment first
    assert lead.margin == pytest.approx(0.0)
    lead = leading_segment(shares, torch.tensor([False, False, True, False]))
    assert (lead.best, lead.runner_up, lead.margin) == (2, None, pytest.approx(0.1))
    free = without_sink(shares, 0)
    assert torch.allclose(free, torch.tensor([0.0, 0.25 / 0.6, 0.1 / 0.6, 0.25 / 0.6]))
    assert torch.equal(without_sink(shares, None), shares)
    assert top_positions(torch.tensor([0.1, 0.5, 0.2, 0.4]), [0, 2, 3], 2) == [
        (3, pytest.approx(0.4)),
        (2, pytest.approx(0.2)),
    ]


def test_kl_divergence_and_share_changes() -> None:
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p.log(), q.log()) == pytest.approx(expected, rel=1e-6)
    assert kl_divergence(p.log(), p.log()) == pytest.approx(0.0, abs=1e-12)
    rows = share_changes({"a": 0.5, "b": 0.3, "c": 0.2}, {"a": 0.45, "b": 0.05, "d": 0.5})
    assert [r[0] for r in rows] == ["d", "b", "c", "a"]
    assert rows[0] == ("d", None, 0.5, 0.5) and rows[2][3] == pytest.approx(-0.2)


# --- the real tokenizer and chat template ----------------------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_chat_segments_with_multibyte_text(smol) -> None:
    inspector = Inspector()
    messages = [
        {"role": "system", "content": "Réponds: é 日本 🙂"},
        {"role": "user", "content": "user"},  # same text as the role marker before it
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again 日本?"},
    ]
    named = [SegmentSpec(name="kanji", text="日本", message=0), SegmentSpec(name="ask", start=0, end=5, message=3)]
    prompt = segment_prompt(inspector, smol, messages, named)
    text, offsets, tokens = prompt.encoded.text, prompt.encoded.offsets, prompt.encoded.tokens
    by_name = {s.name: s for s in prompt.segments}
    assert set(by_name) == {"system#1", "kanji", "user#1", "assistant#1", "user#2", "ask", "template"}
    # every special token (<|im_start|>, <|im_end|>) is the template's; no content token is
    special = {t.position for t in tokens if t.special}
    assert special and special <= set(by_name["template"].positions)
    # each segment's span is the message content exactly
    assert text[by_name["user#1"].char_start : by_name["user#1"].char_end] == "user"
    assert text[by_name["system#1"].char_start : by_name["system#1"].char_end] == "Réponds: é 日本 🙂"
    user_tokens = [tokens[p].text for p in by_name["user#1"].positions]
    assert user_tokens == ["user"] and by_name["user#1"].positions[0] > 3  # the content, not the role marker
    # the split multi-byte tokens of 日本 (they share offsets) all belong to the named segment
    kanji = by_name["kanji"]
    start, end = kanji.char_start, kanji.char_end
    assert text[start:end] == "日本"
    touching = {
        p for p, (s, e) in enumerate(offsets) if any(not text[c].isspace() for c in range(max(s, start), min(e, end)))
    }
    assert set(kanji.positions) == touching and len(kanji.positions) >= 3
    shared = [p for p in kanji.positions if sum(1 for o in offsets if o == offsets[p]) > 1]
    assert shared, "expected byte-level tokens sharing a character's offsets"
    # the emoji and é stay in system#1; "again" is the named span of user#2, "日本?" the rest of the turn
    assert "".join(tokens[p].text for p in by_name["ask"].positions) == "again"
    rest = by_name["user#2"].positions
    assert text[offsets[rest[0]][0] : offsets[rest[-1]][1]].strip() == "日本?"  # offsets overlap: take the range
    # every token has exactly one segment, and segment indices agree with the position lists
    assert len(prompt.token_segment) == prompt.encoded.length
    for index, segment in enumerate(prompt.segments):
        assert all(prompt.token_segment[p] == index for p in segment.positions)
    # the sink split moves position 0 out of the template
    with_sink = prompt.with_sinks([0])
    assert with_sink.segments[0].name == "sink" and 0 not in with_sink.segments[with_sink.index("template")].positions


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("named", "message"),
    [
        (
            [{"name": "x", "text": "absent words"}],
            r"segment 'x': text 'absent words' not found in any message's content",
        ),
        ([{"name": "x", "text": "code", "message": 0}], r"not found in message 0's content"),
        ([{"name": "x", "text": "code", "occurrence": 3}], r"occurrence 3 out of range 1\.\.1"),
        (
            [{"name": "x", "start": 0, "end": 99, "message": 1}],
            r"character span 0\.\.99 out of range.*0 <= start < end <= 17",
        ),
        ([{"name": "x", "start": 5, "end": 5, "message": 1}], r"character span 5\.\.5 out of range"),
        ([{"name": "x", "start": 0, "end": 4}], r"needs message \(0\.\.1\)"),
        ([{"name": "x", "text": "code", "message": 2}], r"message 2 out of range 0\.\.1"),
        ([{"name": "x", "text": "code", "start": 0, "end": 3, "message": 1}], "either text"),
        ([{"name": "x", "start": 0, "message": 1}], "both start and end"),
        ([{"name": "sink", "text": "code"}], "reserved"),
        ([{"name": "user#1", "text": "code"}], "reserved"),
        ([{"name": "a", "text": "the code"}, {"name": "a", "text": "What"}], "given twice"),
        ([{"name": "a", "text": "the code"}, {"name": "b", "text": "code"}], "overlap"),
        ([{"name": "a", "start": 3, "end": 4, "message": 1}], "covers no whole token"),
    ],
)
def test_named_segment_errors(smol, named, message) -> None:
    messages = [{"role": "system", "content": "Keep it short."}, {"role": "user", "content": "What is the code?"}]
    specs = [SegmentSpec.model_validate(n) for n in named]
    with pytest.raises(InvalidInputError, match=message):
        segment_prompt(Inspector(), smol, messages, specs)


@pytest.mark.real_model
def test_plain_text_segments(smol) -> None:
    text = "Paris is in France. Berlin is in Germany. Where is Berlin?"
    prompt = segment_prompt(Inspector(), smol, text, [SegmentSpec(name="fact", text="Berlin is in Germany.")])
    names = [s.name for s in prompt.segments]
    assert names == ["text", "fact"] or names == ["text", "fact", "special"]
    fact = prompt.segments[prompt.index("fact")]
    assert "".join(prompt.encoded.tokens[p].text for p in fact.positions).strip() == "Berlin is in Germany."
    with pytest.raises(InvalidInputError, match="plain text; omit message"):
        segment_prompt(Inspector(), smol, text, [SegmentSpec(name="x", text="Paris", message=0)])
    with pytest.raises(
        InvalidInputError, match=r"character span 0\.\.999 out of range; the text is 58 characters long"
    ):
        segment_prompt(Inspector(), smol, text, [SegmentSpec(name="x", start=0, end=999)])


def test_inserted_spans_find_default_system_prompts_and_date_lines_not_markers() -> None:
    from agent_tools.prompt_segments import inserted_spans

    qwen = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    at = qwen.index("hi there")
    spans = inserted_spans(qwen, [(at, at + 8)], ["<|im_start|>", "<|im_end|>"])
    assert [qwen[a:b] for a, b in spans] == ["You are a helpful assistant."]
    llama = (
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"
        "\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
    )
    at = llama.index("hello")
    markers = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert [llama[a:b] for a, b in inserted_spans(llama, [(at, at + 5)], markers)] == [
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"
    ]
    plain = "### Instruction:\nhello\n### Response:\n"  # role labels of two words or fewer: markers, not inserted
    assert inserted_spans(plain, [(17, 22)], []) == []
