"""Reliability: concurrency gives sequential results, nothing is left behind, weights never change, budgets
and token limits are checked before the run, and any input to any tool yields a valid report or the tool's
error type (property-based). The catalogue of bad inputs through every surface is tests/test_bad_input.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import anyio
import pytest
import torch
from families import build_family
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_calls import TINY, TINY_TEXT, tiny_arguments

from agent_tools import cli
from agent_tools.capture import _ACTIVE, CAPTURE_IMPLEMENTATION, _configs
from agent_tools.cli.mcp import session_inspector
from agent_tools.errors import (
    ERROR_KINDS,
    AttentionToolError,
    CallCancelledError,
    DeadlineExceededError,
    InvalidInputError,
    ResourceLimitError,
)
from agent_tools.inspector import Inspector, check_indices
from agent_tools.loading import LoadedModel
from agent_tools.mcp_front import RpcProblem
from agent_tools.schemas import Report
from agent_tools.session import CallContext, call_scope
from agent_tools.settings import DEFAULT_MEMORY_BUDGET, readable_size
from agent_tools.surfaces.langchain import AttentionToolkit
from agent_tools.surfaces.mcp_server import INVALID_UNICODE_ARGUMENT, build_server, parse_line, serve_http
from agent_tools.tools import TOOLS


def state_hash(model: torch.nn.Module) -> str:
    """sha256 over every state-dict entry's name, dtype, shape and bytes (buffers included)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(memoryview(tensor.detach().contiguous().cpu().numpy()).cast("B"))
    return digest.hexdigest()


def hook_counts(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Forward and pre-forward hooks per module (transformers adds its own output recorders once, lazily)."""
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


VALID_RANGE_WORDS = ("..", "give", "use", "one of", "must", "at most", "at least", "only", "tools:", "try", "accepts")
TINY_TOOLS = [name for name in TOOLS if name != "scaling_experiment"]  # scaling_experiment reads no model


@pytest.mark.parametrize("name", TINY_TOOLS)
def test_tool_changes_no_weight_and_leaves_nothing_behind(name: str, tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    before = state_hash(loaded.model)
    hooks = hook_counts(loaded.model)
    report = TOOLS[name](inspector, tiny_arguments(name, loaded))
    assert isinstance(report, Report)
    assert state_hash(loaded.model) == before
    assert loaded.model.config._attn_implementation != CAPTURE_IMPLEMENTATION
    assert hook_counts(loaded.model) == hooks


def settings_of(model: torch.nn.Module) -> dict[str, Any]:
    """What a call could leave changed besides weights and hooks: configuration, attention implementation, modes."""
    return {
        "config": model.config.to_dict(),
        "attention": [config._attn_implementation_internal for config in _configs(model)],
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
    }


def test_concurrent_calls_equal_sequential_and_restore_everything(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    ids = torch.arange(6, 20)[None]
    with torch.inference_mode():
        logits_before = loaded.model(input_ids=ids).logits.clone()
    settings_before = settings_of(loaded.model)
    hooks = hook_counts(loaded.model)
    calls: list[tuple[str, dict[str, Any]]] = []
    for name in TINY_TOOLS:
        calls.append((name, tiny_arguments(name, loaded)))
    failing = [
        ("show_attention", {"model": TINY, "text": TINY_TEXT, "layer": 7, "head": 0}),
        ("show_attention", {"model": TINY, "text": "", "layer": 0, "head": 0}),
        ("ablate_heads", {"model": TINY, "text": TINY_TEXT, "heads": ["1.9"]}),
    ]
    calls = failing + calls  # every tool once, and the three calls that fail, however many tools there are

    def run(call: tuple[str, dict[str, Any]]) -> str:
        name, arguments = call
        try:
            report = TOOLS[name](inspector, arguments)
        except AttentionToolError as exc:
            return f"error: {exc.message}"
        data = report.model_dump(mode="json")
        data.pop("seconds_per_token", None)  # wall time: the one field allowed to differ
        return json.dumps(data, sort_keys=True)

    sequential = [run(c) for c in calls]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(run, calls))
    assert concurrent == sequential
    assert sum(r.startswith("error:") for r in concurrent) >= 2 and any(not r.startswith("error:") for r in concurrent)
    with torch.inference_mode():
        assert torch.equal(loaded.model(input_ids=ids).logits, logits_before)
    assert settings_of(loaded.model) == settings_before
    assert loaded.model.config._attn_implementation != CAPTURE_IMPLEMENTATION
    assert hook_counts(loaded.model) == hooks
    assert _ACTIVE.get() is None  # no capture left active
    assert threading.active_count() < 50
    # ... and the model is what a fresh load gives: same weights, logits and configuration
    fresh = build_family("llama")
    assert state_hash(fresh) == state_hash(loaded.model)
    with torch.inference_mode():
        assert torch.equal(fresh(input_ids=ids).logits, loaded.model(input_ids=ids).logits)
    assert fresh.config.to_dict() == loaded.model.config.to_dict()


# --- cancellation and deadlines ---------------------------------------------------------------------------------
def lock_is_free(loaded: LoadedModel) -> bool:
    """Whether another thread could take the model's lock now (an RLock held here would re-enter)."""
    free: list[bool] = []

    def probe() -> None:
        taken = loaded.lock.acquire(timeout=5)
        if taken:
            loaded.lock.release()
        free.append(taken)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return free == [True]


class CancelAfter:
    """A consumer that cancels the call after seeing ``layers`` layer calls: a client cancelling mid-pass."""

    accepts_key_prefix = False

    def __init__(self, context: CallContext, layers: int) -> None:
        self.context, self.layers, self.seen = context, layers, []

    def on_layer(self, layer: Any) -> None:
        self.seen.append(layer.layer)
        if len(self.seen) == self.layers:
            self.context.cancel("the test cancelled it")


def test_a_cancelled_pass_stops_between_layers_and_leaves_nothing_behind(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    encoded = inspector.encode(loaded, TINY_TEXT)
    before, settings_before, hooks = state_hash(loaded.model), settings_of(loaded.model), hook_counts(loaded.model)
    reference = inspector.answer_logits(loaded, encoded)
    context = CallContext()
    consumer = CancelAfter(context, layers=1)
    with call_scope(context), pytest.raises(CallCancelledError, match="because the test cancelled it"):
        inspector.run(loaded, encoded, [consumer])
    assert consumer.seen == [0]  # layer 1 never ran
    assert lock_is_free(loaded) and _ACTIVE.get() is None
    assert state_hash(loaded.model) == before and settings_of(loaded.model) == settings_before
    assert hook_counts(loaded.model) == hooks
    assert torch.equal(inspector.answer_logits(loaded, encoded), reference)  # the next call: same numbers


@pytest.mark.parametrize("name", TINY_TOOLS)
def test_every_pass_stops_at_its_deadline(name: str, tiny_models, inspector: Inspector, monkeypatch) -> None:
    loaded = tiny_models["llama"]
    hooks = hook_counts(loaded.model)
    forwards: list[int] = []
    embeddings = loaded.model.get_input_embeddings()  # every pass starts here (full model or base model)
    forward = embeddings.forward
    monkeypatch.setattr(embeddings, "forward", lambda *a, **k: forwards.append(1) or forward(*a, **k))
    with call_scope(CallContext(timeout=0.0)):
        try:
            TOOLS[name](inspector, tiny_arguments(name, loaded))
        except DeadlineExceededError as exc:
            assert "time limit of 0 s and was stopped" in exc.message and exc.kind == "deadline_exceeded"
    assert forwards == []  # a tool that runs the model is stopped before its first forward; others just answer
    assert lock_is_free(loaded) and hook_counts(loaded.model) == hooks
    assert loaded.model.config._attn_implementation != CAPTURE_IMPLEMENTATION


def test_ablation_and_generation_stop_between_layers_and_steps(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    encoded = inspector.encode(loaded, TINY_TEXT)
    hooks = hook_counts(loaded.model)
    context = CallContext(progress_every=0.0)  # progress at every passed check: it counts the checkpoints
    checks: list[float] = []

    def cancel_at_third(elapsed: float) -> None:  # checks: the lock taken, clean layer 0, clean layer 1
        checks.append(elapsed)
        if len(checks) == 3:
            context.cancel("the test cancelled it")

    context.progress = cancel_at_third
    with call_scope(context), pytest.raises(CallCancelledError, match="because the test cancelled it"):
        inspector.ablate(loaded, encoded.input_ids, encoded.attention_mask, [(0, 0)])
    assert len(checks) == 3  # stopped at the ablated pass's first layer
    assert hook_counts(loaded.model) == hooks and lock_is_free(loaded)
    steps: list[int] = []
    context = CallContext()

    def cancel_after_first(step: int, token: int) -> None:
        steps.append(step)
        context.cancel()

    with call_scope(context), pytest.raises(CallCancelledError):
        inspector.generate(loaded, encoded, max_new_tokens=5, on_step=cancel_after_first)
    assert steps == [0] and lock_is_free(loaded)  # the second token was never computed


def test_a_call_waiting_for_the_model_leaves_the_queue_when_cancelled(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    encoded = inspector.encode(loaded, TINY_TEXT)
    context = CallContext()
    outcome: list[BaseException] = []

    def waiting_call() -> None:
        with call_scope(context):
            try:
                inspector.run(loaded, encoded, [])
            except CallCancelledError as exc:
                outcome.append(exc)

    with loaded.lock:  # another call holds the model
        worker = threading.Thread(target=waiting_call)
        worker.start()
        time.sleep(0.3)
        context.cancel("the client went away")
        worker.join(timeout=10)
        assert not worker.is_alive() and len(outcome) == 1  # it left while the lock was still held
    assert "because the client went away" in str(outcome[0])


def test_index_checks_are_linear_and_capped_by_the_model(monkeypatch) -> None:
    from agent_tools import inspector as inspector_module

    calls: list[int] = []
    real = inspector_module.check_index
    monkeypatch.setattr(
        inspector_module, "check_index", lambda v, n, name, **kw: calls.append(v) or real(v, n, name, **kw)
    )
    with pytest.raises(AttentionToolError, match="layers lists 100,000 items but there are only 30; give each"):
        check_indices(list(range(30)) * 3333 + [0] * 10, 30, "layers")
    assert calls == []  # refused on its length, before looking at any item
    with pytest.raises(AttentionToolError, match=r"layers lists duplicates \[3, 7\]; give each index in 0..29 once"):
        check_indices([3, 7, 1, 3, 7, 9], 30, "layers")
    assert len(calls) == 6  # one look per item


@pytest.mark.real_model
def test_ablation_and_profiling_leave_the_default_model_unchanged(smol, inspector: Inspector) -> None:
    text = "The cat sat on the mat because it was tired."
    calls = {
        "ablate_heads": {"text": text, "heads": ["3.0", "5.2"], "method": "mean"},
        "profile_heads": {"text": text, "layers": [3], "ablate_top": 1, "probe_length": 8},  # probe + ablations
    }
    ids = smol.tokenizer(text, return_tensors="pt")["input_ids"]  # type: ignore[operator]
    with torch.inference_mode():
        logits_before = smol.model(input_ids=ids).logits.clone()
    before, settings_before, hooks = state_hash(smol.model), settings_of(smol.model), hook_counts(smol.model)
    for name, arguments in calls.items():
        report = TOOLS[name](inspector, arguments)
        assert isinstance(report, Report) and report.model == "smollm2-135m-instruct"
        assert state_hash(smol.model) == before, f"{name} changed the weights"
        assert settings_of(smol.model) == settings_before and hook_counts(smol.model) == hooks
    with torch.inference_mode():
        assert torch.equal(smol.model(input_ids=ids).logits, logits_before)


# --- resource limits ------------------------------------------------------------------------------------------
def test_budget_and_token_limit_are_named_in_the_error(tiny_models) -> None:
    limited = Inspector(token_limit=5)
    with pytest.raises(AttentionToolError, match="at most 5 tokens"):
        TOOLS["show_attention"](limited, {"model": TINY, "text": TINY_TEXT, "layer": 0, "head": 0})
    tight = Inspector(memory_budget=10)
    with pytest.raises(ResourceLimitError, match=r"would hold about 1 MiB of attention maps, over the budget of 10 B"):
        tight.check_budget(1024**2, "this call")
    assert [readable_size(n) for n in (512, 1536, 64 * 1024**2, 2 * 1024**3, 5000 * 1024**3)] == [
        "512 B",
        "1.5 KiB",
        "64 MiB",
        "2 GiB",
        "5,000 GiB",
    ]


# Every tool that holds T² maps: what it is asked for, and the estimate its error names.
MAP_HOLDERS = {
    "show_attention": {"layer": 1, "head": 0, "include_map": True},
    "reconstruct_attention": {"layer": 1, "head": 0},
    "inspect_projections": {"layer": 1, "head": 0},
    "attention_rollout": {},
    "trace_prompt_attention": {},
    "compare_prompts": {},
}


@pytest.mark.parametrize("name", list(MAP_HOLDERS))
def test_map_holders_check_the_memory_budget_before_the_run(name, tiny_models, monkeypatch) -> None:
    loaded = tiny_models["llama"]
    arguments = {**tiny_arguments(name, loaded), **MAP_HOLDERS[name]}
    assert TOOLS[name](Inspector(), arguments)  # within the default budget

    def no_forward(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model ran before the budget was checked")

    monkeypatch.setattr(loaded.model, "forward", no_forward)
    with pytest.raises(ResourceLimitError) as raised:
        TOOLS[name](Inspector(memory_budget=1024), arguments)
    assert "would hold about " in raised.value.message and "over the budget of 1 KiB" in raised.value.message


def test_show_attention_estimate_grows_with_what_is_asked() -> None:
    from agent_tools.tools.show_attention import held_bytes

    plain = held_bytes(8192, include_map=False, png=False)
    assert plain < DEFAULT_MEMORY_BUDGET < held_bytes(8192, include_map=True, png=False)  # the full map is refused
    assert held_bytes(100, include_map=True, png=True) == 100 * 100 * (9 + 48 + 32)


def test_limits_are_configurable_on_every_surface(tmp_path, capsys) -> None:
    parser = cli.build_parser()
    for argv in (
        ["--token-limit", "7", "--memory-budget", "3", "mcp"],
        ["mcp", "--token-limit", "7", "--memory-budget", "3"],
    ):
        args = parser.parse_args([*argv, "--artifacts", str(tmp_path)])
        session = session_inspector(args)
        assert (session.token_limit, session.memory_budget) == (7, 3 * 1024**2)
        assert session.policy.allowed is not None  # the server's allow-list
    defaults = cli.session_from_args(parser.parse_args(["describe"]))
    assert (defaults.token_limit, defaults.memory_budget) == (None, DEFAULT_MEMORY_BUDGET)
    toolkit = AttentionToolkit(token_limit=7, memory_budget=3 * 1024**2)
    assert (toolkit.session.token_limit, toolkit.session.memory_budget) == (7, 3 * 1024**2)
    for bad in (["--token-limit", "0", "describe"], ["--memory-budget", "-1", "describe"]):
        assert cli.main(bad) == 2
        assert "must be at least 1" in capsys.readouterr().err


def test_http_transport_binds_loopback_unless_told_otherwise(monkeypatch, capsys) -> None:
    import uvicorn

    bound: list[str] = []

    async def serve(self: uvicorn.Server) -> None:  # record where it would listen; listen nowhere
        bound.append(self.config.host)

    monkeypatch.setattr(uvicorn.Server, "serve", serve)
    server = build_server(Inspector(), tools=["describe_model"], preload=False)
    anyio.run(partial(serve_http, server, port=8765))
    assert bound == ["127.0.0.1"] and "warning" not in capsys.readouterr().err
    args = cli.build_parser().parse_args(["mcp", "--transport", "streamable-http"])
    assert args.host == "127.0.0.1"
    anyio.run(partial(serve_http, server, host="0.0.0.0", port=8765))  # only when told, and then with a warning
    assert bound == ["127.0.0.1", "0.0.0.0"] and "reachable beyond this machine" in capsys.readouterr().err


def test_lone_surrogate_lines_are_answered() -> None:
    def line(method: str, params: dict[str, Any]) -> str:
        return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})  # escapes surrogates

    bad = line("tools/call", {"name": "show_attention", "arguments": {"text": "a\ud800", "layer": 0, "head": 0}})
    rewritten = parse_line(bad.encode())
    marker = rewritten.params["arguments"][INVALID_UNICODE_ARGUMENT]
    assert marker["field"] == "text" and "not valid Unicode (e.g. lone surrogates at 1)" in marker["message"]
    prompt = line("prompts/get", {"name": "explain_collapse", "arguments": {"text": "a\udfff"}})
    assert parse_line(prompt.encode()).params["arguments"]["text"] == "a\ufffd"
    for unchanged in (
        line("tools/call", {"name": "show_attention", "arguments": {"text": "smile \U0001f600"}}),  # a valid pair
        line("tools/call", {"name": "show_attention", "arguments": {"text": "plain"}}),
    ):
        assert parse_line(unchanged.encode()).model_dump(by_alias=True, exclude_unset=True) == json.loads(unchanged)
    with pytest.raises(RpcProblem) as malformed:  # a parse error, answered as one
        parse_line(b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"text": "\\ud800"')
    assert malformed.value.code == -32700


SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(st.one_of(st.characters(), SURROGATE), max_size=12))
def test_any_string_makes_an_mcp_line_the_sdk_can_answer(text: str) -> None:
    """Whatever a client's JSON encoder writes for a string, the request reaches a handler (no silent drop)."""
    from mcp import types

    request = {"name": "show_attention", "arguments": {"text": text, "layer": 0, "head": 0}}
    line = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": request})
    parsed = types.jsonrpc_message_adapter.validate_json(parse_line(line.encode()).model_dump_json(by_alias=True))
    assert isinstance(parsed, types.JSONRPCRequest) and parsed.id == 7
    arguments = parsed.params["arguments"]  # type: ignore[index]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        assert set(arguments) == {INVALID_UNICODE_ARGUMENT}
    else:
        assert arguments["text"] == text


# --- property-based: any input ----------------------------------------------------------------------------------
def _mutations() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-5, max_value=40),
        st.sampled_from([2**31, -(2**63), 10**30]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=30),
        st.sampled_from(["", "   ", "\x00\x01", "\ud800", "x" * 5000, "the cat sat", "0.0", "1.1", "99.99", "last"]),
        st.lists(st.integers(min_value=-2, max_value=5), max_size=4),
        st.lists(st.one_of(st.booleans(), st.floats(), st.none()), max_size=3),
        st.lists(st.sampled_from(["0.0", "1.1", "0.9", "x", "previous_token"]), max_size=3),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": st.text()})),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    )


MAX_FORWARDS = 2_000  # forward passes one call may run on the tiny model: a bound on work, not on seconds

PROPERTY_SETTINGS = settings(
    max_examples=25,
    deadline=None,  # no time bound (timing lives in benchmarks/): the bound is MAX_FORWARDS forward passes per call
    derandomize=True,  # the same examples on every run and machine: a failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],  # too_slow is a clock
)


@pytest.mark.parametrize("name", list(TOOLS))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_any_input_gives_a_report_or_a_tool_error(name: str, data: st.DataObject, tiny_models) -> None:
    loaded = tiny_models["llama"]
    inspector = Inspector()
    arguments = tiny_arguments(name, loaded)
    fields = sorted(set(TOOLS[name].input_model.model_fields) | {"unknown_argument"})
    for key in data.draw(st.lists(st.sampled_from(fields), max_size=3, unique=True), label="mutated"):
        arguments[key] = data.draw(_mutations(), label=key)
    if "model" in TOOLS[name].input_model.model_fields and arguments.get("model") != TINY:
        arguments["model"] = TINY  # any other reference would load (or fail to find) a real model
    forwards: list[int] = []  # every pass (whole model, or stopped after the last captured layer) embeds its input
    counter = loaded.model.get_input_embeddings().register_forward_pre_hook(lambda _m, _a: forwards.append(1))
    try:
        report = TOOLS[name](inspector, arguments)
    except AttentionToolError as exc:
        # one line a caller can act on: a known kind, no traceback, and it names the field or what is valid
        assert exc.kind in ERROR_KINDS and exc.to_dict()["message"] == exc.message
        assert len(exc.message) >= 20 and "\n" not in exc.message and "Traceback" not in exc.message
        assert exc.field is not None or any(word in exc.message for word in VALID_RANGE_WORDS), exc.message
    else:
        assert isinstance(report, TOOLS[name].output_model)
        _assert_finite_numbers(report.model_dump(mode="json"))
    finally:
        counter.remove()
    assert len(forwards) <= MAX_FORWARDS, f"{name} ran {len(forwards)} forward passes for one call"


def _assert_finite_numbers(value: Any) -> None:
    if isinstance(value, float):
        assert math.isfinite(value), value
    elif isinstance(value, dict):
        for item in value.values():
            _assert_finite_numbers(item)
    elif isinstance(value, list):
        for item in value:
            _assert_finite_numbers(item)


def test_scaling_experiment_stops_between_training_steps() -> None:
    """The training loop checks the call every step: a cancel after N checks stops it at the next one."""
    checks: list[float] = []
    context = CallContext(progress_every=0.0)  # progress at every passed check: it counts the checkpoints

    def count(_elapsed: float) -> None:
        checks.append(_elapsed)
        if len(checks) == 5:
            context.cancel("the test cancelled it")

    context.progress = count
    with call_scope(context), pytest.raises(CallCancelledError, match="because the test cancelled it"):
        TOOLS["scaling_experiment"](Inspector(), {"steps": 3000, "batch": 8, "items": 4})
    assert len(checks) == 5  # the sixth check raised: no step ran after the cancel


# --- memory that stays bounded over a long session ---------------------------------------------------------------
def test_the_text_store_forgets_the_oldest_text_past_its_capacity() -> None:
    from agent_tools.session import TextStore

    store = TextStore(capacity=3)
    handles = [store.handle(f"text number {i} " * 20) for i in range(5)]
    store.handle("text number 2 " * 20)  # used again: now the most recent
    known = []
    for handle in handles:
        try:
            store.text(handle)
            known.append(handle)
        except InvalidInputError:
            continue
    assert known == [handles[2], handles[3], handles[4]] and len(store._texts) == 3


HEAP_PROBE = """
import gc, threading
from agent_tools.surfaces import heap

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

bounded = heap.bound_arenas()
kept = []

def allocate():  # 64 MiB in 16 KiB blocks (below glibc's mmap threshold: they live in an arena); keep 1 in 16
    blocks = [bytearray(16384) for _ in range(4096)]
    kept.extend(blocks[::16])

start = rss()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
gc.collect()
before = rss()
heap.release()
print(bounded, start, before, rss())
"""


def test_the_server_heap_hands_freed_pages_back() -> None:
    """8 threads each allocate 64 MiB in 16 KiB blocks and keep one block in 16 (32 MiB in all): the freed blocks
    are holes glibc's own trimming (at the top of a heap) cannot return, so they stay resident until
    :func:`heap.release`; after it RSS is back within twice the kept 32 MiB of where it started."""
    import subprocess
    import sys
    from pathlib import Path

    from agent_tools.surfaces import heap

    if heap._glibc() is None:
        pytest.skip("not glibc: nothing to tune")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, env=env, timeout=120)
    bounded, start, before, after = (int(value) if value.isdigit() else value for value in done.stdout.split())
    kept = 8 * 256 * 16384
    assert bounded == "True" and before - start > 3 * kept  # the holes were resident before the release
    assert after - start < 2 * kept
