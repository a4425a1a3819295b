"""Where a model's weights go and in what precision: dtype, device, accelerate device maps, quantization.

The operator's choices arrive as strings (command-line flags, tool arguments) and are checked here before any
weight is read: an unknown value, a device this machine lacks or a model that cannot fit is refused at once
with a one-line :class:`InvalidInputError` / :class:`ResourceLimitError` naming what is valid, instead of a
stack trace from deep inside transformers or an OOM kill minutes later. Sharding across GPUs, the CPU and disk
is accelerate's work, reached through ``from_pretrained(device_map=..., max_memory=..., offload_folder=...)``;
nothing here moves weights itself.

Standard library at import time (torch and transformers are imported inside the functions that need them), so
the command line can build its parser from :data:`DTYPES`, :data:`DEVICE_MAPS` and :data:`QUANTIZATIONS`
without paying for torch.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.settings import CPU_BF16_ENV, cpu_bf16_switched_off, readable_size

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
DeviceMapName = Literal["auto", "balanced", "sequential"]
QuantizationName = Literal["8bit", "4bit"]
DTYPES: tuple[str, ...] = get_args(DtypeName)
DEVICE_MAPS: tuple[str, ...] = get_args(DeviceMapName)
QUANTIZATIONS: tuple[str, ...] = get_args(QuantizationName)
DEVICE_FORMS = "auto, cpu, cuda, cuda:N, mps"
MAX_MEMORY_FORM = (
    "comma-separated DEVICE=SIZE pairs, e.g. 0=70GiB,1=70GiB,cpu=100GiB "
    "(DEVICE: a GPU index, cpu, mps or disk; SIZE: a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
)
QUANTIZED_EXTRA = "pip install attention-explainer[quantized]"
# Share of the memory a device reports free that a load may plan to fill: activations, the tokenizer and
# allocator slack need the rest. An explicit --max-memory is the operator's own budget and is used as given.
HEADROOM = 0.9

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_MEMORY_KEYS = ("cpu", "mps", "disk")
_SAFETENSORS_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_SAFETENSORS_SIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2}
_SAFETENSORS_SIZE.update({"U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1})
# Bytes per weight of a quantized nn.Linear: int8 plus a float32 scale per row (8bit); nf4 nibbles plus a float32
# absmax per 64-weight block (4bit). Embeddings, norms and the output head stay in the compute dtype.
_QUANTIZED_BYTES = {"8bit": 1.0, "4bit": 0.5 + 4 / 64}


@dataclass(frozen=True)
class Placement:
    """How to load a model: precision, device, device map, memory limits, disk offload and quantization.

    ``Placement()`` (all ``auto``) on a machine without an accelerator is bfloat16 on a CPU with bfloat16
    hardware and float32 on any other (:func:`dtype_reason`); on a GPU machine it is the checkpoint's own dtype on
    ``cuda``. Building one
    checks nothing; :meth:`validate` (or :func:`make_placement`) checks it against this machine.
    """

    dtype: DtypeName = "auto"
    device: str = "auto"
    device_map: DeviceMapName | None = None
    max_memory: dict[str | int, str] | None = field(default=None, hash=False)
    offload_folder: str | None = None
    quantization: QuantizationName | None = None

    @property
    def key(self) -> str:
        """A short spelling of the choices (``bfloat16@cpu``, ``auto@auto/map=auto/mem=0=70GiB/4bit``)."""
        parts = [f"{self.dtype}@{self.device}"]
        if self.device_map:
            parts.append(f"map={self.device_map}")
        if self.max_memory:
            parts.append("mem=" + ",".join(f"{k}={v}" for k, v in self.max_memory.items()))
        if self.offload_folder:
            parts.append("offload")
        if self.quantization:
            parts.append(self.quantization)
        return "/".join(parts)

    def validate(self) -> Placement:
        """Refuse what this machine cannot do; return ``self`` so a call can chain. Creates the offload folder."""
        _check_choice("dtype", self.dtype, DTYPES)
        _check_device(self.device)
        if self.device_map is not None:
            _check_choice("device_map", self.device_map, DEVICE_MAPS)
            if self.device != "auto":
                msg = f"give a device ({self.device!r}) or a device map ({self.device_map!r}), not both"
                raise InvalidInputError(msg, field="device_map")
        elif self.max_memory or self.offload_folder:
            msg = f"max_memory and offload_folder only apply with a device map; add one of: {', '.join(DEVICE_MAPS)}"
            raise InvalidInputError(msg, field="device_map")
        if self.max_memory:
            _check_memory_devices(self.max_memory)
        if self.quantization is not None:
            _check_quantization(self)
        if self.offload_folder:
            _check_writable(self.offload_folder)
        return self


def make_placement(
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | None = None,
    max_memory: str | dict[str | int, str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    quantization: str | None = None,
) -> Placement:
    """Build and validate a :class:`Placement` from the operator's strings (command-line flags, surface options)."""
    placement = Placement(
        dtype=dtype.strip().lower(),  # type: ignore[arg-type]  # checked by validate()
        device=device.strip().lower(),
        device_map=(device_map.strip().lower() or None) if device_map else None,  # type: ignore[arg-type]
        max_memory=parse_max_memory(max_memory) if isinstance(max_memory, str) else max_memory,
        offload_folder=str(Path(offload_folder).expanduser()) if offload_folder else None,
        quantization=(quantization.strip().lower() or None) if quantization else None,  # type: ignore[arg-type]
    )
    return placement.validate()


def parse_max_memory(text: str) -> dict[str | int, str]:
    """``0=70GiB,1=70GiB,cpu=100GiB`` → ``{0: "70GiB", 1: "70GiB", "cpu": "100GiB"}`` (sizes kept as written)."""
    result: dict[str | int, str] = {}
    for item in (part.strip() for part in text.split(",")):
        name, sep, size = (piece.strip() for piece in item.partition("="))
        device: str | int = int(name) if name.isdigit() else name.lower()
        if not sep or (device not in _MEMORY_KEYS and not isinstance(device, int)) or device in result:
            msg = f"bad max_memory entry {item!r} in {text!r}; use {MAX_MEMORY_FORM}"
            raise InvalidInputError(msg, field="max_memory")
        size_bytes(size)
        result[device] = size.replace(" ", "")
    return result


def size_bytes(size: str | int) -> int:
    """A size such as ``70GiB`` or ``500MB`` in bytes (GB = 10⁹, GiB = 2³⁰; a bare number is bytes)."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size.strip())
    if match is None or float(match.group(1)) <= 0:
        msg = f"bad memory size {size!r}; use {MAX_MEMORY_FORM}"
        raise InvalidInputError(msg, field="max_memory")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def _check_choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        msg = f"unknown {name} {value!r}; valid: {', '.join(valid)}"
        raise InvalidInputError(msg, field=name)


def devices_here() -> list[str]:
    """The device strings this machine accepts (``auto``, ``cpu``, then ``cuda``, ``cuda:N``, ``mps`` if present)."""
    import torch

    found = ["auto", "cpu"]
    if torch.cuda.is_available():
        found += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if _mps_available():
        found.append("mps")
    return found


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def check_device_form(device: str) -> re.Match[str]:
    """The device's form without importing torch (auto, cpu, cuda, cuda:N, mps), else the one-line error; whether
    this machine has it is :func:`_check_device`'s business."""
    match = _DEVICE.match(device)
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        msg = f"unknown device {device!r}; valid: {DEVICE_FORMS}"
        raise InvalidInputError(msg, field="device")
    return match


def _check_device(device: str) -> None:
    kind, index = check_device_form(device).groups()
    if device not in devices_here():  # auto and cpu always are: kind is mps or cuda
        import torch

        count = torch.cuda.device_count()
        lacks = "MPS" if kind == "mps" else "CUDA" if index is None else f"GPU {index} (it has {count} CUDA devices)"
        msg = f"device {device!r} needs {lacks}, which this machine lacks; valid here: {', '.join(devices_here())}"
        raise InvalidInputError(msg, field="device")


def _check_memory_devices(max_memory: dict[str | int, str]) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device, size in max_memory.items():
        size_bytes(size)
        if isinstance(device, int) and device >= count:
            msg = f"max_memory names GPU {device}, but this machine has {count} CUDA devices; use {MAX_MEMORY_FORM}"
            raise InvalidInputError(msg, field="max_memory")
        if device == "mps" and not _mps_available():
            msg = f"max_memory names mps, which this machine lacks; use {MAX_MEMORY_FORM}"
            raise InvalidInputError(msg, field="max_memory")
        if not isinstance(device, int) and device not in _MEMORY_KEYS:
            msg = f"max_memory names unknown device {device!r}; use {MAX_MEMORY_FORM}"
            raise InvalidInputError(msg, field="max_memory")


def _check_quantization(placement: Placement) -> None:
    import torch

    _check_choice("quantization", placement.quantization, QUANTIZATIONS)
    if not torch.cuda.is_available():
        msg = (
            f"quantization {placement.quantization!r} needs a CUDA GPU, which this machine lacks; "
            "leave quantization unset here (valid with CUDA: 8bit, 4bit)"
        )
        raise InvalidInputError(msg, field="quantization")
    if not resolve_device(placement).startswith("cuda"):  # cuda or cuda:N
        msg = f"quantization {placement.quantization!r} runs on CUDA only; use device auto, cuda or cuda:N"
        raise InvalidInputError(msg, field="quantization")
    if importlib.util.find_spec("bitsandbytes") is None:
        msg = f"quantization {placement.quantization!r} needs bitsandbytes: {QUANTIZED_EXTRA}"
        raise InvalidInputError(msg, field="quantization")


def _check_writable(folder: str) -> None:
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        msg = f"offload folder {folder!r} cannot be created or written ({exc.strerror or exc}); give a writable folder"
        raise InvalidInputError(msg, field="offload_folder") from exc


def resolve_device(placement: Placement) -> str:
    """The main device: the one asked for, else ``cuda`` if present, else ``mps`` if present, else ``cpu``."""
    import torch

    if placement.device != "auto":
        return placement.device
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if _mps_available() else "cpu"


def checkpoint_dtype(config: object | None) -> torch.dtype | None:
    """The floating dtype a config says its weights were saved in (``dtype``, older ``torch_dtype``), if any."""
    import torch

    # transformers 5 keeps ``torch_dtype`` as a deprecated alias of ``dtype`` (reading it prints a warning), so the old
    # name is read only from a config without the new one
    value = getattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


# CPU flags whose presence means bfloat16 matmuls run in hardware (AMX tiles, AVX-512 BF16 dot products). Without
# them bfloat16 is emulated: on this project's 2-core AVX2 CPU a bfloat16 forward of the default model took 6.6x
# the float32 one (benchmarks/bench_real_models.py dtype); with them it is 4-5x faster than float32.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags() -> tuple[str, ...]:
    """The :data:`CPU_BF16_FLAGS` this CPU reports in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return tuple(flag for flag in CPU_BF16_FLAGS if flag in flags)


def resolve_dtype(placement: Placement, config: object | None = None) -> torch.dtype:
    """The dtype to load: the one asked for; ``auto`` = the checkpoint's own on an accelerator; on the CPU
    bfloat16 where it has bfloat16 hardware (:func:`cpu_bf16_flags`) unless the operator switched that off
    (``$ATTENTION_EXPLAINER_CPU_BF16=0``), else float32 (see :func:`dtype_reason`)."""
    import torch

    if placement.dtype != "auto":
        return getattr(torch, placement.dtype)
    if resolve_device(placement) == "cpu":
        return torch.bfloat16 if cpu_bf16_flags() and not cpu_bf16_switched_off() else torch.float32
    own = checkpoint_dtype(config)
    return own if own in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def dtype_reason(placement: Placement, config: object | None = None) -> str:
    """Why the placement loads the dtype it does, in words."""
    chosen = dtype_name(resolve_dtype(placement, config))
    if placement.dtype != "auto":
        return f"{chosen}: the operator's --dtype"
    if resolve_device(placement) != "cpu":
        return f"{chosen}: auto on an accelerator runs the checkpoint's own precision"
    flags = cpu_bf16_flags()
    found = ", ".join(flags)
    if flags and cpu_bf16_switched_off():
        return f"{chosen}: auto on a CPU whose bfloat16 hardware ({found}) is switched off ({CPU_BF16_ENV}=0)"
    if flags:
        return f"{chosen}: auto on a CPU with bfloat16 hardware ({found})"
    return (
        f"{chosen}: auto on a CPU without bfloat16 hardware (no {' or '.join(CPU_BF16_FLAGS)} flag: bfloat16 emulated)"
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_key(placement: Placement) -> str:
    """:attr:`Placement.key` with what this machine decides filled in, so ``auto`` and its meaning share a cache."""
    device = resolve_device(placement)
    dtype: Any = placement.dtype
    if dtype == "auto" and device == "cpu":
        dtype = dtype_name(resolve_dtype(placement))
    return replace(placement, dtype=dtype, device=device if placement.device_map is None else "auto").key


def from_pretrained_kwargs(placement: Placement, config: object | None) -> dict[str, Any]:
    """The keyword arguments for ``from_pretrained`` that carry out a placement (accelerate does the sharding)."""
    dtype = resolve_dtype(placement, config)
    device = resolve_device(placement)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if placement.device_map is not None:
        kwargs["device_map"] = placement.device_map
    elif device != "cpu":
        kwargs["device_map"] = {"": device}
    if placement.max_memory:
        kwargs["max_memory"] = {device: size_bytes(size) for device, size in placement.max_memory.items()}
    if placement.offload_folder:
        kwargs["offload_folder"] = placement.offload_folder
    if placement.quantization is not None:
        from transformers import BitsAndBytesConfig

        if placement.quantization == "8bit":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            )
    return kwargs


def meta_model(config: object, *, causal: bool | None = None) -> nn.Module:
    """The model a config describes, built on the meta device: every shape, no storage (70B costs nothing)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    if causal is None:
        causal = _default_causal(config)
    cls = AutoModelForCausalLM if causal else AutoModel
    with torch.device("meta"):
        return cls.from_config(copy.deepcopy(config), trust_remote_code=False)


def _default_causal(config: object) -> bool:
    """Architectures decide; without any, count the language-model head if the family has one (the upper bound)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "architectures", None):
        return is_causal_lm(config)
    return getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_causal_lm(config: object) -> bool:
    """Whether the config's architectures name a causal language model (``...ForCausalLM``, ``...LMHeadModel``)."""
    architectures = getattr(config, "architectures", None) or []
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)


# Tokens the load-time check sizes one pass for (a tool's pass over a longer text is checked by the inspector's
# budgets before it runs); capped by the model's own maximum positions.
CHECK_TOKENS = 2048
# Query rows of one layer's attention are computed in blocks of at most this many bytes on the CPU (the inspector's
# chunking; smaller blocks stay in cache and let causal chunks skip more keys: 64 MB beat 256 MB by 8 %).
ATTENTION_BLOCK_BYTES = 64 * 1024**2
# On an accelerator a block may take this share of the device's free memory (at least the CPU's block): one row per
# block at 87k tokens and 32 heads wastes a GPU, and the free memory left after the weights is what a block may use.
DEVICE_FREE_SHARE = 0.25
BLOCK_COPIES = 3  # float32 (q, Tk) tensors per head a block holds: scores, logits, weights


def attention_block_bytes(device: torch.device | str) -> int:
    """Bytes one block of query rows may hold on ``device``: :data:`ATTENTION_BLOCK_BYTES` on the CPU (or a device
    whose free memory cannot be read); on CUDA :data:`DEVICE_FREE_SHARE` × the free memory
    ``torch.cuda.mem_get_info`` reports now, at least the CPU's block."""
    import torch

    where = torch.device(device)
    if where.type != "cuda" or not torch.cuda.is_available():
        return ATTENTION_BLOCK_BYTES
    free, _total = torch.cuda.mem_get_info(where)
    return max(ATTENTION_BLOCK_BYTES, int(free * DEVICE_FREE_SHARE))


def query_chunk_rows(num_heads: int, length: int, block_bytes: int) -> int | None:
    """Query rows per block so that a layer's (heads, rows, length) float32 scores, logits and weights fit in
    ``block_bytes``; None when every row fits in one block. At least one row."""
    per_row = BLOCK_COPIES * num_heads * length * 4
    rows = max(1, block_bytes // max(per_row, 1))
    return None if rows >= length else int(rows)


@dataclass(frozen=True)
class MemoryEstimate:
    """What a load and one pass hold, from the config alone (bytes).

    ``weights``: the loaded parameters and buffers. ``load_copy``: the checkpoint's own tensors, mapped in its
    saved precision while each is converted into the model's (0 for a quantized load, and for a load in the
    precision the file was saved in: the model's tensors are then the mapped file's own pages, no second copy).
    ``working_set``: one forward over ``tokens`` tokens — hidden states and projections of one layer, the MLP's
    intermediate, one block of attention scores/weights, the KV cache, and the float32 next-token logits.
    The load copy is released before a pass runs, so the peak is ``weights + max(load_copy, working_set)``.
    """

    weights: int
    load_copy: int
    working_set: int
    tokens: int

    @property
    def peak(self) -> int:
        return self.weights + max(self.load_copy, self.working_set)


def estimate_memory(
    config: object,
    dtype: torch.dtype,
    *,
    causal: bool | None = None,
    quantization: str | None = None,
    folder: str | os.PathLike[str] | None = None,
    tokens: int | None = None,
) -> MemoryEstimate:
    """:class:`MemoryEstimate` of loading ``config``'s model in ``dtype`` and running one pass over ``tokens``.

    The weights are counted from the config alone (parameters × dtype size, plus buffers); ``folder``, when it
    holds safetensors files, cross-checks the count against their headers (no weights are read) and the larger of
    the two wins, so a config that undercounts cannot let an oversize load through.
    """
    weights = weights_bytes(meta_model(config, causal=causal), dtype, quantization=quantization)
    saved = checkpoint_dtype(config)
    on_disk = checkpoint_bytes(folder, dtype, saved) if folder and not quantization else None
    if on_disk is not None and abs(on_disk - weights) > 0.1 * max(weights, 1):
        logger.warning("config estimate %d bytes, checkpoint headers %d bytes; using the larger", weights, on_disk)
    weights = max(weights, on_disk or 0)
    # the file's tensors, mapped in its saved precision while they are converted into the model's: measured, a
    # bfloat16 checkpoint loaded in float32 peaks at weights + the file; loaded in bfloat16 the model's tensors are
    # the mapped pages themselves (resident memory +0.01 GiB after from_pretrained, the pages fault in during the
    # first pass), so there is no copy (benchmarks/results-memory.md). A config that does not say how the file was
    # saved is counted as a conversion.
    in_place = saved == dtype and (folder is None or _safetensors_files(Path(folder)) is not None)  # pickles: copied
    load_copy = 0 if quantization or in_place else weights * (saved or dtype).itemsize // dtype.itemsize
    limit = _config_int(config, "max_position_embeddings", "n_positions", "max_seq_len") or CHECK_TOKENS
    length = tokens if tokens is not None else min(CHECK_TOKENS, limit)
    return MemoryEstimate(weights, load_copy, pass_bytes(config, dtype, length), length)


def _config_int(config: object, *names: str) -> int | None:
    for source in (config, getattr(config, "text_config", None)):
        for name in names:
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def pass_bytes(config: object, dtype: torch.dtype, tokens: int) -> int:
    """Bytes one forward over ``tokens`` tokens holds beyond the weights (see :class:`MemoryEstimate`)."""
    item = dtype.itemsize
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model") or 0
    heads = _config_int(config, "num_attention_heads", "n_head", "encoder_attention_heads") or 1
    kv_heads = _config_int(config, "num_key_value_heads", "n_head_kv") or heads
    head_dim = _config_int(config, "head_dim") or (hidden // heads if heads else 0)
    inner = _config_int(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff") or 4 * hidden
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers") or 1
    vocab = _config_int(config, "vocab_size") or 0
    per_token = (
        4 * hidden  # residual stream, normed input, attention output, MLP output
        + (heads + 2 * kv_heads) * head_dim  # q, k, v of the running layer
        + 3 * inner  # gate, up and the activation of the MLP
        + 2 * layers * kv_heads * head_dim  # the KV cache a causal forward returns
    ) * item
    logits = tokens * vocab * (item + 4)  # the head's logits in dtype and their float32 copy
    attention = min(ATTENTION_BLOCK_BYTES, BLOCK_COPIES * heads * tokens * tokens * 4)  # one block of query rows
    return tokens * per_token + logits + attention


def weights_bytes(model: nn.Module, dtype: torch.dtype, *, quantization: str | None = None) -> int:
    """Bytes ``model``'s weights take in ``dtype``: parameters × dtype size (quantized linears at their packed
    size), plus buffers as they are. Works on a meta-device model (nothing allocated) and on a loaded one."""
    itemsize = dtype.itemsize
    quantized = _quantized_linear_weights(model) if quantization else set()
    total = 0.0
    for name, param in model.named_parameters():
        per = _QUANTIZED_BYTES[quantization] if quantization and name in quantized else itemsize
        total += param.numel() * per
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    return int(total)


def _quantized_linear_weights(model: nn.Module) -> set[str]:
    """Names of the weights bitsandbytes converts: every nn.Linear's, except the output head (kept in dtype)."""
    from torch import nn

    getter = getattr(model, "get_output_embeddings", None)
    output = getter() if callable(getter) else None
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not output and not name.endswith("lm_head")
    }


def _safetensors_files(folder: Path) -> list[Path] | None:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    return files or None


def checkpoint_bytes(
    folder: str | os.PathLike[str], dtype: torch.dtype, saved_dtype: torch.dtype | None = None
) -> int | None:
    """Bytes a folder's safetensors weights take once loaded in ``dtype``, from the file headers only.

    Each shard's header (8-byte length, then JSON of dtype/shape per tensor) gives exact element counts; an
    index whose shards are absent falls back to its ``metadata.total_size`` scaled from the saved dtype.
    ``None`` when the folder has no safetensors weights or they cannot be read.
    """
    path = Path(folder)
    try:
        files = _safetensors_files(path)
        if files is None:
            return None
        if not all(f.is_file() for f in files):
            return _index_total(path, dtype, saved_dtype)
        return sum(_shard_bytes(f, dtype.itemsize) for f in files)
    except (OSError, ValueError, KeyError, struct.error):
        return None


def _shard_bytes(file: Path, itemsize: int) -> int:
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        numel = math.prod(info["shape"])
        kind = info["dtype"]
        total += numel * (itemsize if kind in _SAFETENSORS_FLOAT else _SAFETENSORS_SIZE.get(kind, itemsize))
    return total


def _index_total(folder: Path, dtype: torch.dtype, saved_dtype: torch.dtype | None) -> int | None:
    index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, int) or saved_dtype is None:
        return None
    return total * dtype.itemsize // saved_dtype.itemsize


def available_memory(device: str | int) -> int | None:
    """Free bytes on a device now: the host's available memory for ``cpu``/``mps`` (unified memory; psutil, which
    accelerate requires), free memory for a GPU. ``None`` for a device this machine cannot read (no CUDA); a check
    then lets the load try.
    """
    if isinstance(device, str) and device in ("cpu", "mps"):
        import psutil

        return int(psutil.virtual_memory().available)
    import torch

    if isinstance(device, int):
        index = device
    else:
        match = _DEVICE.match(device)
        if match is None or match.group(1) != "cuda" or not torch.cuda.is_available():
            return None
        index = int(match.group(2)) if match.group(2) is not None else torch.cuda.current_device()
    free, _total = torch.cuda.mem_get_info(index)
    return int(free)


def memory_budget(placement: Placement) -> tuple[int | None, str]:
    """The bytes a placement may fill and that budget in words; ``None`` = unlimited or unknown.

    One device: what it has free × :data:`HEADROOM`. A device map: the sum of ``max_memory``'s memory devices
    when given, else every GPU's free memory plus the CPU's (the disk of an offload folder is checked apart).
    """
    if placement.device_map is None:
        device = resolve_device(placement)
        free = available_memory(device)
        if free is None:
            return None, f"{device} memory is unknown"
        return int(free * HEADROOM), f"{device} has {readable_size(free)} free ({HEADROOM:.0%} usable)"
    if placement.max_memory:
        memory = {k: v for k, v in placement.max_memory.items() if k != "disk"}
        if not memory:
            return None, "max_memory names only disk"
        budget = sum(size_bytes(s) for s in memory.values())
        names = ", ".join(f"{k}={v}" for k, v in placement.max_memory.items())
        return budget, f"max_memory ({names}) allows {readable_size(budget)}"
    import torch

    devices: list[str | int] = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    frees = [available_memory(d) for d in [*devices, "cpu"]]
    if any(f is None for f in frees):
        return None, "memory is unknown"
    free = sum(f or 0 for f in frees)
    where = f"{len(devices)} GPUs and the CPU have {readable_size(free)} free ({HEADROOM:.0%} usable)"
    return int(free * HEADROOM), where


def check_fits(
    estimate: int | MemoryEstimate,
    placement: Placement,
    *,
    dtype: torch.dtype | None = None,
    what: str = "the model",
) -> None:
    """Refuse a load that cannot fit before any weight is read, per device, with the numbers and the flag to add.

    With a :class:`MemoryEstimate`: on one device the load-time peak (weights + the checkpoint copy held while
    converting, or + one pass's working set) must fit that device; on an accelerator the weights and the working
    set go there and the checkpoint copy is read on the host. With a device map the weights beyond the memory
    budget (what ``max_memory`` allows, else what the devices have free) spill to the offload folder, whose disk
    must have room for them. A plain number is weights only (the GGUF conversion's check).
    """
    plan = estimate if isinstance(estimate, MemoryEstimate) else MemoryEstimate(estimate, 0, 0, 0)
    precision = dtype_name(dtype) if dtype is not None else placement.dtype
    problem = _placement_problem(plan, placement)
    if problem is None:
        return
    import torch

    advice = []
    if (dtype is None or dtype == torch.float32) and placement.quantization is None:
        advice.append("add --dtype bfloat16 (half of float32)")
    if placement.device_map is None:
        advice.append("add --device-map auto --offload-folder DIR (spill layers to CPU RAM and disk)")
    elif not placement.offload_folder:
        advice.append("add --offload-folder DIR (spill the layers that do not fit to disk)")
    if torch.cuda.is_available() and placement.quantization is None:
        advice.append("add --quantization 4bit (CUDA)")
    if not advice:
        advice.append("free memory or disk, or use a machine with more")
    msg = f"{what} in {precision} {problem}; try: {'; '.join(advice)}"
    raise ResourceLimitError(msg, field="model")


def _sizes(plan: MemoryEstimate) -> str:
    parts = [f"weights {readable_size(plan.weights)}"]
    if plan.load_copy:
        parts.append(f"+ {readable_size(plan.load_copy)} checkpoint mapped while loading")
    if plan.working_set:
        parts.append(f"+ {readable_size(plan.working_set)} for a {plan.tokens:,}-token pass")
    return ", ".join(parts)


def _placement_problem(plan: MemoryEstimate, placement: Placement) -> str | None:
    """What does not fit, in words (None when everything does)."""
    budget, where = memory_budget(placement)
    if placement.device_map is None:
        device = resolve_device(placement)
        on_device = plan.peak if device == "cpu" else plan.weights + plan.working_set
        if budget is not None and on_device > budget:
            return (
                f"needs about {readable_size(on_device)} ({on_device:,} bytes) on {device} ({_sizes(plan)}) but {where}"
            )
        host = available_memory("cpu")
        if device != "cpu" and host is not None and plan.load_copy > host * HEADROOM:
            return (
                f"reads a {readable_size(plan.load_copy)} checkpoint copy on the host while converting, but the "
                f"CPU has {readable_size(host)} free"
            )
        return None
    needed = plan.weights + plan.working_set
    if budget is None or needed <= budget:
        return None
    spill = needed - budget
    disk = placement.offload_folder
    if disk is None:
        return (
            f"needs about {readable_size(needed)} ({needed:,} bytes; {_sizes(plan)}) but {where}, and nothing may "
            "spill to disk"
        )
    free_disk = disk_free(disk)
    if free_disk is not None and spill > free_disk:
        return (
            f"spills about {readable_size(spill)} to the offload folder {disk!r} ({_sizes(plan)}; {where}) but its "
            f"disk has {readable_size(free_disk)} free"
        )
    return None


def disk_free(folder: str | os.PathLike[str]) -> int | None:
    """Free bytes on the disk holding ``folder`` (its nearest existing parent); None when it cannot be read."""
    import shutil

    path = Path(folder).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return None
