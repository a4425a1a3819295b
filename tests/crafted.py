"""Tiny one-layer models whose attention heads are set by hand to fixed positional patterns.

Token embeddings are zero and position ``p`` is embedded as ``(cos pα, sin pα, −cos pα, −sin pα, 0, …)``: mean 0
and the same norm at every position, so the first LayerNorm only scales it by a constant ``s``. A head with
offset ``o`` gets ``q_i = M·u_{i+o}`` and ``k_j = u_j`` with ``u_p = (cos pα, sin pα)``, so its score is
``M·cos((i + o − j)·α)``: the maximum is at ``j = i + o`` and the next key is ``M·(1 − cos α)/sqrt(d_head) ≈ 52``
logits lower, so the weight there is 1 to float32 precision. A "sink" head has a constant query ``M·u_0`` (from
the bias) and reads key 0; a "uniform" head has ``q = 0`` and spreads evenly over the keys it may see.
Valid for sequences shorter than the period ``2π/α = 40`` positions.
"""

from __future__ import annotations

import math

import torch
import transformers as tf

ALPHA = 2 * math.pi / 40
SCALE_M = 12000.0
HIDDEN, HEADS, HEAD_DIM = 64, 8, 8

# head -> pattern: an int offset o (key = query + o), "sink" or "uniform"
Pattern = int | str


def _rotation(angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    return torch.tensor([[c, -s], [s, c]])


def _position_table(count: int) -> torch.Tensor:
    p = torch.arange(count, dtype=torch.float32) * ALPHA
    table = torch.zeros(count, HIDDEN)
    table[:, 0], table[:, 1], table[:, 2], table[:, 3] = p.cos(), p.sin(), -p.cos(), -p.sin()
    return table


def _norm_scale(eps: float) -> float:
    return 1 / math.sqrt(4 / (2 * HIDDEN) + eps)  # LayerNorm of the 4-dim pattern: variance 2/HIDDEN


def crafted_gpt2(patterns: dict[int, Pattern]) -> torch.nn.Module:
    """A one-layer GPT-2 LM (causal) whose heads follow ``patterns``; unlisted heads are uniform."""
    config = tf.GPT2Config(
        n_layer=1, n_head=HEADS, n_embd=HIDDEN, vocab_size=96, n_positions=64, bos_token_id=0, eos_token_id=1
    )
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).eval()
    block = model.transformer.h[0]
    s = _norm_scale(block.ln_1.eps)
    with torch.no_grad():
        model.transformer.wte.weight.zero_()  # tied to lm_head: logits are 0, every token equally likely
        model.transformer.wpe.weight.copy_(_position_table(64))
        weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias  # Conv1D (in, 3·C): x @ W + b
        weight.zero_()
        bias.zero_()
        for head, pattern in patterns.items():
            q, k = head * HEAD_DIM, HIDDEN + head * HEAD_DIM
            weight[0:2, k : k + 2] = torch.eye(2) / s  # k_j = u_j
            if pattern == "sink":
                bias[q : q + 2] = SCALE_M * torch.tensor([1.0, 0.0])  # q = M·u_0
            elif isinstance(pattern, int):
                weight[0:2, q : q + 2] = SCALE_M / s * _rotation(pattern * ALPHA).T  # q_i = M·u_{i+o}
    return model


def crafted_bert(patterns: dict[int, Pattern]) -> torch.nn.Module:
    """A one-layer BERT encoder (bidirectional) whose heads follow ``patterns``; unlisted heads are uniform."""
    config = tf.BertConfig(
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        hidden_size=HIDDEN,
        intermediate_size=64,
        vocab_size=96,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = tf.BertModel(config, add_pooling_layer=False).eval()
    embeddings = model.embeddings
    attention = model.encoder.layer[0].attention.self
    s = _norm_scale(embeddings.LayerNorm.eps)
    with torch.no_grad():
        embeddings.word_embeddings.weight.zero_()
        embeddings.token_type_embeddings.weight.zero_()
        embeddings.position_embeddings.weight.copy_(_position_table(64))
        for linear in (attention.query, attention.key):
            linear.weight.zero_()
            linear.bias.zero_()
        for head, pattern in patterns.items():
            rows = slice(head * HEAD_DIM, head * HEAD_DIM + 2)  # nn.Linear (out, in): W x + b
            attention.key.weight[rows, 0:2] = torch.eye(2) / s
            if pattern == "sink":
                attention.query.bias[rows] = SCALE_M * torch.tensor([1.0, 0.0])
            elif isinstance(pattern, int):
                attention.query.weight[rows, 0:2] = SCALE_M / s * _rotation(pattern * ALPHA)
    return model
