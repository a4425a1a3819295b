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


# --- a two-layer attention-only circuit: previous-token head → induction head (K-composition), and a no-op sink ---
CIRCUIT_WORDS = (  # noqa: SIM905 - one readable block of words
    "the cat dog sat on mat red blue green one two three four five six seven eight nine ten sun moon star tree "
    "rock bird fish king queen"
).split()  # 28 words after <bos> <eos> <unk> <pad>: vocabulary 32
CIRCUIT_VOCAB = 32
CIRCUIT_HIDDEN, CIRCUIT_HEADS, CIRCUIT_HEAD_DIM = 128, 4, 32
CIRCUIT_ALPHA = 2 * math.pi / 128  # position code period: longer than any sequence the model takes (64)
PREVIOUS_HEAD, INDUCTION_HEAD, SINK_HEAD = (0, 0), (1, 0), (1, 1)  # (layer, head)
UNIFORM_HEADS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3))  # uniform attention, writing a constant aside
# residual subspaces: position code, token code, previous-token code (L0H0 writes), output code (L1H0 writes),
# the uniform heads' writes, the sink head's writes, the <bos> code; nothing reads the last three
_POS, _TOK, _PREV, _OUT = slice(0, 4), slice(4, 36), slice(36, 68), slice(68, 100)
_ASIDE, _SINK_OUT, _BOS = slice(100, 104), slice(104, 124), slice(126, 128)


def circuit_tokenizer(*, bos: bool = True):
    """A word-level tokenizer over :data:`CIRCUIT_WORDS` that puts <bos> first (offsets, no downloads); with
    ``bos=False`` the first word is position 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<unk>", "<pad>", *CIRCUIT_WORDS]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )


def _token_codes() -> torch.Tensor:
    """(V, 32): token t ≥ 1 gets the centred one-hot e_t − 1/32 (zero mean, so LayerNorm only rescales), unit norm;
    <bos> gets 0 (it writes nothing). Different tokens' codes have inner product −1/31."""
    codes = torch.eye(CIRCUIT_VOCAB) - 1 / CIRCUIT_VOCAB
    codes = codes / codes.norm(dim=-1, keepdim=True)
    codes[0] = 0
    return codes


def _position_codes(count: int) -> torch.Tensor:
    p = torch.arange(count, dtype=torch.float32) * CIRCUIT_ALPHA
    return torch.stack([p.cos(), p.sin(), -p.cos(), -p.sin()], dim=-1)  # (count, 4): zero mean


def induction_circuit(*, score: float = 1e5, match: float = 20.0, unembed: float = 0.3) -> torch.nn.Module:
    """A two-layer attention-only GPT-2 LM whose answer is known by construction.

    * L0H0, previous-token head: query ``u_{i−1}``, key ``u_j`` from the position code, so position i reads i − 1;
      it copies that token's code into the "previous token" subspace.
    * L1H0, induction head (K-composition): its query is the current token's code, its key the previous-token code
      L0H0 wrote, so the last token reads the position after its earlier occurrence and copies that token's code
      into the output subspace, the only one the unembedding reads: ``A B … A`` predicts ``B``.
    * L1H1, sink head: a constant query that matches position 0, whose value (the <bos> code) is 0: it reads
      position 0 and writes nothing.
    * Every other head has a zero query and key (uniform attention) and a constant value (its bias), written into
      a subspace nothing reads: the same write at every position of every prompt. The MLPs are zero.

    Every code has zero mean and every position the same norm in layer 0 (<bos> carries a code of its own), so
    the LayerNorms only rescale and the argmax of every score is where it was designed to be. The positional heads
    need a large ``score`` (neighbouring position codes differ little); the induction head's ``match`` keeps its
    scores near 60, so two equally good keys split its attention 50/50 to float32 precision.
    """
    config = tf.GPT2Config(
        n_layer=2,
        n_head=CIRCUIT_HEADS,
        n_embd=CIRCUIT_HIDDEN,
        vocab_size=CIRCUIT_VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.zero_()
        for block in model.transformer.h:
            for module in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                module.bias.zero_()
        codes = _token_codes()
        model.transformer.wte.weight[:, _TOK] = codes
        model.transformer.wte.weight[0, _BOS] = torch.tensor([1.0, -1.0]) / math.sqrt(2)  # <bos>: same norm
        model.transformer.wpe.weight[:, _POS] = _position_codes(64)
        _previous_token_head(model.transformer.h[0].attn, score)
        _induction_and_sink_heads(model.transformer.h[1].attn, score, match)
        for layer, head in UNIFORM_HEADS:  # a constant, zero-mean value written aside
            attention = model.transformer.h[layer].attn
            start = 2 * CIRCUIT_HIDDEN + head * CIRCUIT_HEAD_DIM
            attention.c_attn.bias[start : start + 2] = torch.tensor([0.1, -0.1])
            rows = slice(head * CIRCUIT_HEAD_DIM, head * CIRCUIT_HEAD_DIM + 2)
            attention.c_proj.weight[rows, _ASIDE.start : _ASIDE.start + 2] = torch.eye(2)
        model.lm_head.weight[:, _OUT] = unembed * codes * math.sqrt(CIRCUIT_HIDDEN)
    return model


def _previous_token_head(attention: torch.nn.Module, score: float) -> None:
    """L0H0: q_i = score·R(−α)·u_i = score·u_{i−1}, k_j = u_j; value = token code -> previous-token subspace."""
    width, d = CIRCUIT_HIDDEN, CIRCUIT_HEAD_DIM
    c, s = math.cos(-CIRCUIT_ALPHA), math.sin(-CIRCUIT_ALPHA)
    attention.c_attn.weight[0:2, 0:2] = score * torch.tensor([[c, -s], [s, c]]).T
    attention.c_attn.weight[0:2, width : width + 2] = torch.eye(2)
    attention.c_attn.weight[_TOK, 2 * width : 2 * width + d] = torch.eye(d)
    attention.c_proj.weight[0:d, _PREV] = torch.eye(d)


def _induction_and_sink_heads(attention: torch.nn.Module, score: float, match: float) -> None:
    """L1H0: q = current token code, k = previous-token code (K-composition); value = token code -> output.
    L1H1: a constant query (bias) matching position 0's code; its value, the token code, is 0 at <bos>."""
    width, d, eye = CIRCUIT_HIDDEN, CIRCUIT_HEAD_DIM, torch.eye(CIRCUIT_HEAD_DIM)
    weight = attention.c_attn.weight
    weight[_TOK, 0:d] = match * eye
    weight[_PREV, width : width + d] = eye
    weight[_TOK, 2 * width : 2 * width + d] = eye
    attention.c_proj.weight[0:d, _OUT] = eye
    attention.c_attn.bias[d : d + 2] = score * torch.tensor([1.0, 0.0])
    weight[0:2, width + d : width + d + 2] = torch.eye(2)
    weight[_TOK, 2 * width + d : 2 * width + 2 * d] = eye
    attention.c_proj.weight[torch.arange(d, 2 * d), torch.arange(d) % 20 + _SINK_OUT.start] = 1.0


def collapse_circuit(*, bias: float = 4.0) -> torch.nn.Module:
    """:func:`induction_circuit` with two collapsed heads of known effect, for a tokenizer without <bos>
    (``circuit_tokenizer(bos=False)``: position 0 is the first word).

    * L1H1, load-bearing: it reads position 0 whatever the query (the sink head's query) and writes that word's
      code into the output subspace, so every position predicts the first word. Its output is the same at every
      position (mean-ablation changes nothing), but another text's first word changes it (resample-ablation does).
    * L1H2, constant-output: the same collapse onto position 0, but its value is the constant bias (0.1, −0.1),
      written ``bias`` times into the output subspace: a learned logit bias. Its output is exactly the same at every
      position of every text, so mean- and resample-ablation change nothing (zero-ablation does).
    * L0H1, L0H2, L0H3 and L1H3 stay uniform heads writing a constant aside: removing them changes nothing.
    """
    model = induction_circuit()
    width, d = CIRCUIT_HIDDEN, CIRCUIT_HEAD_DIM
    attention = model.transformer.h[1].attn
    with torch.no_grad():
        proj = attention.c_proj.weight  # Conv1D (in = H·D, out = C)
        proj[d : 2 * d] = 0
        proj[d : 2 * d, _OUT] = torch.eye(d)  # L1H1 writes the first word's code where the unembedding reads
        head = 2
        attention.c_attn.bias[head * d : head * d + 2] = 1e5 * torch.tensor([1.0, 0.0])  # query matches position 0
        attention.c_attn.weight[0:2, width + head * d : width + head * d + 2] = torch.eye(2)  # key: position code
        proj[head * d : (head + 1) * d] = 0
        proj[head * d : head * d + 2, _OUT.start : _OUT.start + 2] = bias * torch.eye(2)
    return model


# --- a tiny model trained in seconds to retrieve a value past a distractor of filler ------------------------------
RETRIEVAL_FILLER = ("the", ".", ",", "and", "of", "a")
RETRIEVAL_DIGITS = tuple(str(d) for d in range(10))
RETRIEVAL_WORDS = (*RETRIEVAL_FILLER, "code", "is", "?", *RETRIEVAL_DIGITS)
# The question is the chat template's generation prompt: template tokens, so only the distractor and the fact
# compete as content segments.
RETRIEVAL_TEMPLATE = (
    "<bos> {% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}code ?{% endif %}"
)


def retrieval_tokenizer():
    """Word-level: <bos> <eos> <unk> <pad>, the filler, 'code is ?', the digits; <bos> first. Its chat template
    writes the messages after <bos> and asks "code ?"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<unk>", "<pad>", *RETRIEVAL_WORDS]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = RETRIEVAL_TEMPLATE
    return tokenizer


def retrieval_example(generator: torch.Generator, digit: int | None = None) -> tuple[str, str, str, int]:
    """(distractor, fact, question, answer digit): "<filler…> code is D code ?" with the fact before or after."""
    count = int(torch.randint(6, 33, (1,), generator=generator))
    filler = [RETRIEVAL_FILLER[int(i)] for i in torch.randint(0, len(RETRIEVAL_FILLER), (count,), generator=generator)]
    value = int(torch.randint(0, 10, (1,), generator=generator)) if digit is None else digit
    return " ".join(filler), f"code is {value}", "code ?", value


def retrieval_model(*, seed: int = 0, steps: int = 200) -> torch.nn.Module:
    """A one-layer Llama (3 heads, width 48) trained on "<distractor> <fact> <question>" → the fact's digit.

    The distractor is 6–32 filler tokens ('the', '.', ',' …) and comes before or after the fact at random, so the
    model must find the digit by content, not by position. Heads 1 and 2 keep zero query and key weights (uniform
    attention, as many real heads are nearly), so raw attention averaged over heads favours the long distractor
    while the answer depends on the three-token fact. Trained with Adam on the answer position only; a few seconds
    on one CPU thread.
    """
    tokenizer = retrieval_tokenizer()
    config = tf.LlamaConfig(
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        hidden_size=48,
        intermediate_size=64,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    attention = model.model.layers[0].self_attn
    uniform = slice(16, 48)  # heads 1 and 2: rows of q_proj and k_proj
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list(RETRIEVAL_DIGITS)))
    for _ in range(steps):
        texts, answers = [], []
        for _ in range(32):
            distractor, fact, question, value = retrieval_example(generator)
            first, second = (distractor, fact) if bool(torch.rand(1, generator=generator) < 0.5) else (fact, distractor)
            texts.append(f"{first} {second} {question}")
            answers.append(int(digit_ids[value]))
        batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
        logits = model(**batch).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(answers))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            attention.q_proj.weight[uniform] = 0
            attention.k_proj.weight[uniform] = 0
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
