"""Tiny random-weight models of the families agent_tools/adapters.py routes (BLOOM, MPT, Falcon, DeBERTa-v2), and
Falcon-ALiBi's reference attention. Shared by tests/test_adapters.py and the coverage list in tests/families.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers as tf
from torch import Tensor, nn

from agent_tools.capture import attention_implementation

VOCAB = 96


def _decoder(config: tf.PretrainedConfig) -> nn.Module:
    return tf.AutoModelForCausalLM.from_config(config)


CONFIGS: dict[str, Callable[[], tf.PretrainedConfig]] = {
    "bloom": lambda: tf.BloomConfig(n_layer=2, n_head=4, hidden_size=32, vocab_size=VOCAB),
    "bloom_tp": lambda: tf.BloomConfig(
        n_layer=2, n_head=4, hidden_size=32, vocab_size=VOCAB, pretraining_tp=2, slow_but_exact=True
    ),
    "mpt": lambda: tf.MptConfig(n_layers=2, n_heads=4, d_model=32, vocab_size=VOCAB, max_seq_len=64),
    "mpt_clip": lambda: tf.MptConfig(
        n_layers=2,
        n_heads=4,
        d_model=32,
        vocab_size=VOCAB,
        max_seq_len=64,
        attn_config={"clip_qkv": 1.5, "softmax_scale": 0.6, "alibi_bias_max": 4},
    ),
    "falcon_alibi": lambda: tf.FalconConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        vocab_size=VOCAB,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=False,
        bias=True,
    ),
    "falcon_alibi_mq": lambda: tf.FalconConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        vocab_size=VOCAB,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=True,
    ),
    "falcon": lambda: tf.FalconConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        hidden_size=32,
        vocab_size=VOCAB,
        new_decoder_architecture=True,
    ),
    "falcon_mq": lambda: tf.FalconConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        vocab_size=VOCAB,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
    ),
    "deberta_v3": lambda: tf.DebertaV2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=32,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
    ),
    "deberta_v2": lambda: tf.DebertaV2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        relative_attention=True,
        pos_att_type=["c2p"],
        max_relative_positions=6,
        share_att_key=False,
        conv_kernel_size=3,
    ),
    "deberta_plain": lambda: tf.DebertaV2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        relative_attention=False,
        pos_att_type=None,
    ),
}
DECODERS = ("bloom", "bloom_tp", "mpt", "mpt_clip", "falcon_alibi", "falcon_alibi_mq", "falcon", "falcon_mq")
# Falcon-ALiBi's eager path (output_attentions=True) adds ALiBi twice; its default (sdpa) path adds it once.
DOUBLE_ALIBI_EAGER = ("falcon_alibi", "falcon_alibi_mq")


def build(name: str, *, seed: int = 0) -> nn.Module:
    """A tiny random-weight model, q/k (and relative-position) projections scaled up for peaked maps."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    model = tf.AutoModel.from_config(config) if name.startswith("deberta") else _decoder(config)
    factor = 16.0 if name.startswith("deberta") else 12.0  # ≥ 20% of rows then have a weight > 0.5
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 2 and any(part in param_name for part in ("query", "key", "Wqkv", "rel_embeddings")):
                param.mul_(factor)
    return model.eval()


def inputs(name: str) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(6, VOCAB, (2, 11), generator=generator)
    mask = torch.ones_like(ids)
    if name.startswith("deberta"):
        mask[1, -3:] = 0  # right padding
    else:
        mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def peaked_share(maps: list[Tensor] | tuple[Tensor, ...], rows: Tensor | None = None) -> float:
    """The share of rows (reading at least 3 keys) whose largest weight is > 0.5; ``rows`` (B, 1, T, 1) picks rows."""
    picked = [weights if rows is None else weights.masked_fill(~rows, 0) for weights in maps]
    flat = torch.cat([weights.flatten(0, 2) for weights in picked])  # (rows, keys)
    real = (flat > 0).sum(-1) >= 3
    return float((flat[real].amax(-1) > 0.5).float().mean())


@contextmanager
def falcon_masks_without_alibi(model: nn.Module) -> Iterator[None]:
    """Inside the block each Falcon layer gets a plain 0/min mask instead of the one with alibi/√D merged in.

    transformers 5.24's FalconModel merges alibi/√D into the mask it passes its layers (for its sdpa path); its
    eager path then adds alibi·(1/√D) again: ALiBi twice. Without the merged part the model's own eager code adds
    ALiBi once, which is what its default sdpa path (and ALiBi's definition) computes.
    """

    def clean(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask = kwargs.get("attention_mask")
        if mask is not None and kwargs.get("alibi") is not None:
            blocked = mask <= torch.finfo(mask.dtype).min / 2
            kwargs["attention_mask"] = torch.zeros_like(mask).masked_fill(blocked, torch.finfo(mask.dtype).min)
        return args, kwargs

    layers = [m for m in model.modules() if type(m).__name__ == "FalconAttention"]
    handles = [m.register_forward_pre_hook(clean, with_kwargs=True) for m in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def falcon_alibi_reference(model: nn.Module, **inputs: Tensor) -> Any:
    """Falcon-ALiBi's own eager attention with ALiBi added once (see :func:`falcon_masks_without_alibi`)."""
    with attention_implementation(model, "eager"), falcon_masks_without_alibi(model), torch.inference_mode():
        return model(**inputs, output_attentions=True)
