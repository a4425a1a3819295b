"""Loading resolves references offline, caches per process, and refuses what it must."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from agent_tools.errors import ModelNotFoundError, ModelRefusedError
from agent_tools.loading import (
    BUNDLED_MODELS,
    ModelPolicy,
    _gguf_cache_key,
    cache_dir,
    convert_gguf,
    load_model,
    loaded_models,
    resolve_reference,
)
from agent_tools.placement import Placement


def test_aliases_resolve_to_package_files() -> None:
    smol = resolve_reference("smollm2-135m-instruct")
    assert smol.kind == "gguf" and smol.path is not None and smol.path.is_file()
    mini = resolve_reference("minilm-l6")
    assert mini.kind == "folder" and (mini.path / "config.json").is_file()
    assert resolve_reference(None).alias == "smollm2-135m-instruct"


def test_unknown_alias_lists_the_bundled_ones() -> None:
    with pytest.raises(ModelNotFoundError, match="bundled aliases: minilm-l6, smollm2-135m-instruct"):
        resolve_reference("gpt-17-ultra")


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_reference(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="holds no model"):
        resolve_reference(str(tmp_path))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"12")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        resolve_reference(str(text))


def test_hub_id_offline_not_cached_names_aliases() -> None:
    source = resolve_reference("someone/some-model")
    assert source.kind == "hub"
    with pytest.raises(ModelNotFoundError, match="bundled aliases"):
        load_model("someone/some-model")


def test_corrupt_and_truncated_gguf_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        convert_gguf(bad)
    source = resolve_reference("smollm2-135m-instruct").path
    truncated = tmp_path / "truncated.gguf"
    with source.open("rb") as handle:
        truncated.write_bytes(handle.read(200_000))
    os.environ["ATTENTION_EXPLAINER_CACHE"] = str(tmp_path / "cache")
    try:
        with pytest.raises(ModelNotFoundError, match="truncated or corrupt"):
            load_model(str(truncated))
    finally:
        del os.environ["ATTENTION_EXPLAINER_CACHE"]


def test_gguf_cache_key_changes_with_the_file(tmp_path: Path) -> None:
    copy = tmp_path / "m.gguf"
    copy.write_bytes(b"GGUF" + b"\1" * 4096)
    first = _gguf_cache_key(copy)
    assert _gguf_cache_key(copy) == first
    copy.write_bytes(b"GGUF" + b"\2" * 4096)
    assert _gguf_cache_key(copy) != first


def test_cache_dir_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTENTION_EXPLAINER_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path


def test_remote_code_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mystery", "auto_map": {"AutoModel": "x.Model"}}))
    with pytest.raises(ModelRefusedError, match="remote code is never run"):
        load_model(str(folder))


def test_folder_with_broken_config_is_a_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="could not load model folder"):
        load_model(str(folder))


@pytest.mark.real_model
def test_models_are_cached_per_process_in_eval_mode(smol) -> None:
    assert load_model("smollm2-135m-instruct") is smol
    assert not smol.model.training
    assert not any(p.requires_grad for p in smol.model.parameters())


@pytest.mark.real_model
def test_default_placement_is_float32_on_the_cpu(smol, minilm) -> None:
    assert load_model("smollm2-135m-instruct", Placement(dtype="float32", device="cpu")) is smol
    for loaded in (smol, minilm):
        assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
        assert loaded.placement == Placement() and loaded.estimated_bytes is not None
    assert smol.estimated_bytes == pytest.approx(538.1e6, rel=0.01)  # 134.5 M parameters x 4 bytes
    assert minilm.estimated_bytes == pytest.approx(90.9e6, rel=0.02)
    assert {"smollm2-135m-instruct", "minilm-l6"} <= set(loaded_models())


@pytest.mark.real_model
def test_local_folder_loads(minilm, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(resolve_reference("minilm-l6").path, folder)
    loaded = load_model(str(folder))
    assert loaded is not minilm and loaded.facts.family == "bert"


def test_policy_allow_list() -> None:
    policy = ModelPolicy.bundled_only()
    assert policy.check(None) == "smollm2-135m-instruct"
    assert policy.check("minilm-l6") == "minilm-l6"
    with pytest.raises(ModelRefusedError, match="allowed: minilm-l6, smollm2-135m-instruct"):
        policy.check("/etc")
    assert set(BUNDLED_MODELS) <= set(policy.allowed or ())


class _MakesAFolder:
    """An object whose unpickling would call ``os.mkdir(marker)``: the code a malicious weights file runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_a_pickle_that_would_run_code_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """torch's weights_only loader stops it; the refusal names the file, says to convert to safetensors, never to
    turn the check off, and the pickled call never ran (it was exit 1 and a traceback suggesting
    ``weights_only=False``)."""
    from families import build_family, tiny_tokenizer

    from agent_tools import cli

    folder, marker = tmp_path / "unsafe", tmp_path / "the-payload-ran"
    model = build_family("llama")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "payload": _MakesAFolder(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelRefusedError) as refused:
        load_model(str(folder))
    message = refused.value.message
    assert message.startswith(f"refused to load {folder / 'pytorch_model.bin'}: a pickle file that holds objects")
    assert "(posix.mkdir)" in message or "(nt.mkdir)" in message
    assert "convert the weights to safetensors" in message and "weights_only" not in message
    assert not marker.exists()
    capsys.readouterr()  # what saving the model printed
    assert (
        cli.main(["call", "show_attention", "--model", str(folder), "--json", '{"text": "hi", "layer": 0, "head": 0}'])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: refused to load") and "Traceback" not in err
    assert not marker.exists()


def test_source_config_names_the_folder_not_the_hub_when_a_folder_cannot_be_read(tmp_path, monkeypatch) -> None:
    """describe_model reads a source's config without weights: a folder that cannot be read is the folder's problem,
    never "not in the local cache and the hub is offline" (which only a hub name gets)."""
    import transformers

    from agent_tools.loading import ModelSource, source_config

    folder = ModelSource(reference=str(tmp_path), kind="folder", path=tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"has an unreadable config\.json") as missing:
        source_config(folder)  # no config.json at all
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))

    def unreadable(*args, **kwargs):
        raise OSError("a file the config names is missing")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreadable)
    with pytest.raises(ModelNotFoundError, match=r"could not load model folder .*a file the config names") as refused:
        source_config(folder)
    assert "hub" not in missing.value.message and "hub" not in refused.value.message
    with pytest.raises(ModelNotFoundError, match="is not in the local cache and the hub is offline"):
        source_config(ModelSource(reference="nobody/no-such-model", kind="hub", path=None))
