"""Tiny random-weight models of every family we claim, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn

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
