"""Tiny random-weight models of every family we claim, built from configs (no downloads).

``FAMILIES`` are the text families every tool runs on (the ``tiny_models`` fixture registers them). ``COVERAGE`` is
the one parity list: every family the project covers, each either exact (its stacks and score terms) or refused
(and why). ``tests/test_family_coverage.py`` runs parity for every exact entry and asserts the refusal of every
refused one; ``scripts/family_coverage.py`` prints the README's coverage table from it (a test keeps them equal).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from adapted import build as build_adapted
from adapted import falcon_alibi_reference
from torch import Tensor, nn

VOCAB = 96


def _decoder(config: tf.PretrainedConfig) -> nn.Module:
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


FAMILY_CONFIGS = {
    "gpt2": lambda: tf.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=1
    ),
    "bert": lambda: tf.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    ),
    "llama": lambda: tf.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    ),
    "mistral": lambda: tf.MistralConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        sliding_window=4,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    ),
    "qwen2": lambda: tf.Qwen2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    ),
    "gemma2": lambda: tf.Gemma2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        sliding_window=4,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    ),
    "gpt_neox": lambda: tf.GPTNeoXConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        rotary_pct=0.25,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
    ),
    "opt": lambda: tf.OPTConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        ffn_dim=64,
        vocab_size=VOCAB,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    ),
    "phi3": lambda: tf.Phi3Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    ),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def build_family(name: str, *, seed: int = 0) -> nn.Module:
    """A deterministic tiny model of the family, eval mode, eager attention by default."""
    torch.manual_seed(seed)
    config = FAMILY_CONFIGS[name]()
    model = tf.AutoModel.from_config(config, attn_implementation="eager") if name == "bert" else _decoder(config)
    # Random init is gentle; larger weights give peaked, informative attention maps to compare.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 2 and ("q" in param_name or "k" in param_name or "attn" in param_name):
                param.mul_(3.0)
    return model.eval()


def tiny_tokenizer():
    """A word-level fast tokenizer over VOCAB ids with offsets and a BOS token (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<unk>", "<pad>", "[CLS]", "[SEP]"]
    words += [
        w
        for w in [
            "the",
            "a",
            "cat",
            "dog",
            "sat",
            "on",
            "mat",
            "because",
            "it",
            "was",
            "tired",
            ".",
            ",",
            "and",
            "of",
            "to",
            "in",
            "is",
            "that",
            "he",
            "she",
            "they",
        ]
    ]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


# --- the coverage list -------------------------------------------------------------------------------------------

ATTENTIONS = {"self": "attentions", "encoder": "encoder_attentions", "decoder": "decoder_attentions"}
ATTENTIONS["cross"] = "cross_attentions"
SEQ2SEQ = ("encoder", "decoder", "cross")


@dataclass(frozen=True)
class Coverage:
    """One family of the coverage list.

    exact: ``build()`` gives a tiny peaked model whose captured weights, on ``inputs()``, equal the family's own
    eager ``output_attentions`` (or ``reference(model, **inputs)`` where that is the family's own) on every stack,
    with ``terms`` the score terms the capture includes. refused: ``refuse(model)`` raises UnsupportedModelError
    whose message matches ``refusal`` (a regex); ``why`` is the README's words for it.
    """

    name: str  # the key (tests' parameter id)
    family: str  # the model_type the model reports
    label: str  # the README's row: which checkpoints the row covers
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, Tensor]]
    stacks: tuple[str, ...] = ("self",)
    terms: tuple[str, ...] = ()  # score terms captured (any stack)
    refusal: str = ""  # non-empty: refused, the message matches this regex
    refuse: Callable[[nn.Module], object] | None = None  # what raises the refusal (None: capturing inputs())
    captured: bool = True  # capture is exact (parity runs), also where the tools refuse the model (Whisper)
    why: str = ""  # the README's reason (refused) or note (exact)
    # the family's own attention with output_attentions, when its plain eager forward is not it (Falcon-ALiBi's
    # eager branch adds ALiBi twice); None: the eager forward (tests/reference.py eager_reference)
    reference: Callable[..., Any] | None = None


def _peaked(model: nn.Module, factor: float, *suffixes: str) -> nn.Module:
    """Scale the q/k projections (parameters whose names end with ``suffixes``) so attention rows are peaked."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.mul_(factor)
    return model.eval()


def _ids(batch: int = 2, length: int = 11, seed: int = 1) -> Tensor:
    return torch.randint(6, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def decoder_inputs() -> dict[str, Tensor]:
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def encoder_inputs() -> dict[str, Tensor]:
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask}


def seq2seq_inputs() -> dict[str, Tensor]:
    ids = _ids(length=9)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # the encoder's right padding: the cross-attention mask
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": _ids(length=6, seed=2)}


def whisper_inputs() -> dict[str, Tensor]:
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))  # (B, mel bins, 2·positions)
    return {"input_features": features, "decoder_input_ids": _ids(length=6, seed=2)}


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return seeded


_PROJ = ("q_proj.weight", "k_proj.weight")
_FAMILY_QK = (*_PROJ, "query.weight", "key.weight", "c_attn.weight", "query_key_value.weight", "qkv_proj.weight")


def _more_peaked(name: str, factor: float) -> Callable[[], nn.Module]:
    """``build_family(name)`` (whose ×3 leaves most rows near uniform) with its q/k projections × ``factor``."""
    return lambda: _peaked(build_family(name), factor, *_FAMILY_QK)


_T5_QK = ("q.weight", "k.weight")


def _t5(config_class: type, factor: float = 1.5) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = config_class(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1, feed_forward_proj="gated-gelu",
        )  # fmt: skip
        return _peaked(tf.AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager"), factor, *_T5_QK)

    return _seeded(build)


def _bart_like(config_class: type, factor: float = 4.0, **extra: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = config_class(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, **extra,
        )  # fmt: skip
        return _peaked(tf.AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager"), factor, *_PROJ)

    return _seeded(build)


def _distilbert() -> nn.Module:
    config = tf.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64
    )
    return _peaked(tf.AutoModel.from_config(config, attn_implementation="eager"), 12.0, "q_lin.weight", "k_lin.weight")


def _modernbert() -> nn.Module:
    config = tf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, cls_token_id=0, sep_token_id=2,
    )  # fmt: skip
    return _peaked(tf.AutoModel.from_config(config, attn_implementation="eager"), 12.0, "Wqkv.weight")


def _gpt_oss() -> nn.Module:
    config = tf.GptOssConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
        intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, vocab_size=VOCAB, sliding_window=4,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    model = _peaked(_decoder(config), 8.0, *_PROJ)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))  # init leaves them empty
    return model


DEEPSEEK_YARN = {
    "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
}  # fmt: skip


def _deepseek_v3() -> nn.Module:
    config = tf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=64, rope_parameters=dict(DEEPSEEK_YARN),
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    return _peaked(_decoder(config), 16.0, "q_b_proj.weight", "kv_b_proj.weight")


def _whisper() -> nn.Module:
    config = tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return _peaked(tf.AutoModelForSpeechSeq2Seq.from_config(config, attn_implementation="eager"), 20.0, *_PROJ)


def _albert() -> nn.Module:
    config = tf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return tf.AutoModel.from_config(config, attn_implementation="eager").eval()


def _text_tools(model: nn.Module) -> object:
    from agent_tools.families import read_facts

    read_facts(model).require_text_input("tiny")
    return None


def _facts(model: nn.Module) -> object:
    from agent_tools.families import read_facts

    return read_facts(model)


_SINK, _RPB = ("sink logit",), ("relative position bias",)

COVERAGE: list[Coverage] = [
    *(
        Coverage(
            name,
            FAMILY_CONFIGS[name]().model_type,
            label,
            _more_peaked(name, factor),
            encoder_inputs if name == "bert" else decoder_inputs,
            why=why,
        )
        for name, label, factor, why in [
            ("gpt2", "GPT-2", 4.0, ""),
            ("bert", "BERT, RoBERTa-style encoders", 7.0, ""),
            ("llama", "Llama 2/3, SmolLM2 (GQA)", 4.0, ""),
            ("mistral", "Mistral (sliding window)", 4.0, ""),
            ("qwen2", "Qwen2", 4.0, ""),
            ("gemma2", "Gemma 2 (soft-capping)", 6.0, ""),
            ("gpt_neox", "GPT-NeoX, Pythia (partial rotary)", 4.0, ""),
            ("opt", "OPT", 4.0, "scale folded into the query projection"),
            ("phi3", "Phi-3", 4.0, ""),
        ]
    ),
    Coverage(
        "distilbert",
        "distilbert",
        "DistilBERT",
        _seeded(_distilbert),
        encoder_inputs,
        why="modules carry no layer_idx: layers numbered in module order",
    ),
    Coverage(
        "modernbert",
        "modernbert",
        "ModernBERT",
        _seeded(_modernbert),
        encoder_inputs,
        why="modules keep no `scaling`: head_dim^-0.5, as their forward passes; local + global layers",
    ),
    Coverage(
        "t5",
        "t5",
        "T5, Flan-T5, UL2",
        _t5(tf.T5Config),
        seq2seq_inputs,
        SEQ2SEQ,
        _RPB,
        why="scores are not scaled (scaling 1.0); cross-attention has no bias",
    ),
    Coverage("mt5", "mt5", "mT5", _t5(tf.MT5Config), seq2seq_inputs, SEQ2SEQ, _RPB),
    Coverage(
        "umt5",
        "umt5",
        "UMT5",
        _t5(tf.UMT5Config),
        seq2seq_inputs,
        SEQ2SEQ,
        _RPB,
        why="a relative position bias table in every self-attention layer",
    ),
    Coverage("bart", "bart", "BART", _bart_like(tf.BartConfig, 12.0), seq2seq_inputs, SEQ2SEQ),
    Coverage("mbart", "mbart", "mBART", _bart_like(tf.MBartConfig, 12.0), seq2seq_inputs, SEQ2SEQ),
    Coverage("marian", "marian", "Marian (Opus-MT)", _bart_like(tf.MarianConfig, 24.0), seq2seq_inputs, SEQ2SEQ),
    Coverage("pegasus", "pegasus", "Pegasus", _bart_like(tf.PegasusConfig, 20.0), seq2seq_inputs, SEQ2SEQ),
    Coverage(
        "gpt_oss",
        "gpt_oss",
        "GPT-OSS",
        _seeded(_gpt_oss),
        decoder_inputs,
        terms=_SINK,
        why="learned per-head sink logit: an extra softmax column (its weight: LayerAttention.sink_share)",
    ),
    Coverage(
        "deepseek_v3",
        "deepseek_v3",
        "DeepSeek-V3 (MLA)",
        _seeded(_deepseek_v3),
        decoder_inputs,
        why="q·k width qk_nope + qk_rope, value width v_head_dim; scaling includes yarn mscale²",
    ),
    Coverage(
        "whisper",
        "whisper",
        "Whisper",
        _seeded(_whisper),
        whisper_inputs,
        SEQ2SEQ,
        refusal=r"reads audio `input_features`.*not text",
        refuse=_text_tools,
        captured=True,
        why="the text tools refuse it (it reads audio input_features, not text); capture itself is exact on "
        "given input_features from Python (capture_attention)",
    ),
    Coverage(
        "albert",
        "albert",
        "ALBERT",
        _seeded(_albert),
        encoder_inputs,
        refusal=r"shares one attention module",
        refuse=_facts,
        captured=False,
        why="one attention module shared by every layer: capture cannot tell the layers apart",
    ),
    # --- A2 (agent_tools/adapters.py: BLOOM, MPT, Falcon, DeBERTa-v2) appends its entries below this line ---
    Coverage(
        "bloom",
        "bloom",
        "BLOOM, BLOOMZ",
        lambda: build_adapted("bloom"),
        decoder_inputs,
        terms=("ALiBi",),
        why="computes attention inline: routed through its adapter (agent_tools/adapters.py); the ALiBi term is "
        "the model's own alibi tensor; pretraining_tp > 1 with slow_but_exact: head ablation refused",
    ),
    Coverage(
        "mpt",
        "mpt",
        "MPT",
        lambda: build_adapted("mpt_clip"),
        decoder_inputs,
        terms=("ALiBi",),
        why="adapter; ALiBi for max_seq_len positions (longer inputs refused, as the model fails on them); "
        "softmax_scale and clip_qkv as the model applies them (with clip_qkv per-head W_Q/W_K are refused)",
    ),
    Coverage(
        "falcon",
        "falcon",
        "Falcon-7B (multi-query, rotary)",
        lambda: build_adapted("falcon_mq"),
        decoder_inputs,
        why="adapter; one K/V head shared by every query head",
    ),
    Coverage(
        "falcon_new_decoder",
        "falcon",
        "Falcon-40B/180B (new decoder architecture, GQA)",
        lambda: build_adapted("falcon"),
        decoder_inputs,
        why="adapter; K/V heads grouped in the fused projection (read per group)",
    ),
    Coverage(
        "falcon_alibi",
        "falcon",
        "Falcon-RW (ALiBi)",
        lambda: build_adapted("falcon_alibi"),
        decoder_inputs,
        terms=("ALiBi",),
        why="adapter; ALiBi once, as the model's default (sdpa) path adds it: transformers' eager path (any "
        "output_attentions=True) adds it twice, so the reference is its eager code with the merged ALiBi taken "
        "out of the mask (tests/adapted.py)",
        reference=falcon_alibi_reference,
    ),
    Coverage(
        "deberta_v3",
        "deberta-v2",
        "DeBERTa-v3 (shared position keys, log buckets)",
        lambda: build_adapted("deberta_v3"),
        encoder_inputs,
        terms=("c2p/p2c",),
        why="adapter; content→position and position→content terms are the module's own, scale 1/√(3·D)",
    ),
    Coverage(
        "deberta_v2",
        "deberta-v2",
        "DeBERTa-v2 (separate position projections, conv layer)",
        lambda: build_adapted("deberta_v2"),
        encoder_inputs,
        terms=("c2p/p2c",),
        why="adapter; here c2p only, scale 1/√(2·D)",
    ),
]
COVERAGE_BY_NAME = {entry.name: entry for entry in COVERAGE}


def _cell(words: tuple[str, ...]) -> str:
    return ", ".join(words) if words else "—"


def coverage_table() -> str:
    """The README's coverage table, from COVERAGE (``scripts/family_coverage.py`` prints it)."""
    lines = [
        "| family | capture | stacks | score terms captured | notes |",
        "|---|---|---|---|---|",
    ]
    for entry in COVERAGE:
        if not entry.captured:
            status = "refused"
        elif entry.refusal:
            status = "exact (Python API); tools refuse"
        else:
            status = "exact (≤ 1e-5)"
        stacks = _cell(entry.stacks) if entry.captured else "—"
        note = re.sub(r"\s+", " ", entry.why).strip()
        lines.append(f"| {entry.label} (`{entry.family}`) | {status} | {stacks} | {_cell(entry.terms)} | {note} |")
    return "\n".join(lines) + "\n"
