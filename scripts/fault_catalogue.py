"""The fault-injection catalogue of issue 20, rerun after the fixes: for each fault, what happens now.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/fault_catalogue.py [--calls 300] [--out catalogue.json]

Every fault is injected the way a user or a client meets it — a real CLI process, a real MCP server over stdio
or HTTP (loopback only) — on the default model. The conversion-cache faults run in a private, temporary cache
(``ATTENTION_EXPLAINER_CACHE``): the user's converted cache is never touched. Each cache fault costs one rebuild
(about 20 s on two cores), so the whole catalogue takes 6-10 minutes; ``--skip-cache`` leaves those out.

The closing figure is an HTTP run: ``--calls`` calls from 8 concurrent sessions, every 20th a long call that is
cancelled as soon as it reports progress; it counts server deaths, compares every answer with the same call made
serially, and reads the server's RSS before and after. ``--quick`` leaves out the cache faults and the 8,031-token
call past the time limit and makes the HTTP run 40 calls (a few minutes: the check that the catalogue still runs).

The soak (``--soak-minutes N``, 30 when no N is given; nothing else runs) keeps 8 HTTP clients busy for N minutes
with the mixed calls, fresh texts (so caches keyed by text fill) and a cancelled long call every 20th, samples the
server's RSS every 10 s, and says whether it plateaus: the last third of the run grows RSS by less than 5 %. It
writes a Markdown table (``--table``, default benchmarks/results-soak.md). The 30-minute run is meant for a quiet
machine:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/fault_catalogue.py --soak-minutes 30

Clients use the MCP 2.x SDK (``mcp.Client``); as the protocol says, a cancelled request gets no answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
CLI = [sys.executable, "-m", "agent_tools.cli"]
LONG = "the cat sat on the mat . " * 600  # about 4,200 tokens: a call that runs many seconds
VERY_LONG = "the cat sat on the mat because it was tired . " * 730  # 8,031 tokens: the 103 s call
SHORT = "The cat sat on the mat because it was tired."
INITIALIZE = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "catalogue", "version": "1"}}
Row = dict[str, Any]
_DEQUANTISING = re.compile(r"de-quantizing GGUF tensors[^\r\n]*\| 0/")  # the first frame of transformers' bar


def dequantisations(stderr: str) -> int:
    """How many GGUF conversions a CLI run did (each starts transformers' progress bar at 0/N)."""
    return len(_DEQUANTISING.findall(stderr))


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> Row:
    """Run the CLI once; its exit code, its ``error:`` lines, whether it printed a traceback, and its seconds."""
    start = time.perf_counter()
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env or ENV, cwd=ROOT, timeout=timeout)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return {
        "exit": done.returncode,
        "error": errors[-1][:200] if errors else None,
        "traceback": "Traceback" in done.stderr,
        "rebuilt": "rebuilding it once" in done.stderr,
        "dequantised": dequantisations(done.stderr),
        "seconds": round(time.perf_counter() - start, 1),
    }


# --- the conversion cache -------------------------------------------------------------------------------------
def _target(cache: Path) -> Path:
    folders = [p for p in (cache / "gguf").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(folders) == 1, folders
    return folders[0]


def _damage(kind: str, folder: Path) -> None:
    weights = folder / "model.safetensors"
    if kind == "truncated_weights":
        with weights.open("r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    elif kind == "emptied_weights":
        weights.write_bytes(b"")
    elif kind == "deleted_weights":
        weights.unlink()
    elif kind == "random_4k_in_weights":
        with weights.open("r+b") as handle:
            handle.seek(weights.stat().st_size // 2)
            handle.write(os.urandom(4096))
    elif kind == "broken_config":
        (folder / "config.json").write_text('{"model_type": "llama", ')
    elif kind == "deleted_config":
        (folder / "config.json").unlink()
    elif kind == "broken_tokenizer":
        (folder / "tokenizer.json").write_text("{")


CACHE_FAULTS = (
    "truncated_weights",
    "emptied_weights",
    "deleted_weights",
    "random_4k_in_weights",
    "broken_config",
    "deleted_config",
    "broken_tokenizer",
)


def cache_faults(work: Path) -> dict[str, Row]:
    """Convert once into a private cache, then for each fault: restore, damage, start the CLI, start it again."""
    cache = work / "cache"
    env = {**ENV, "ATTENTION_EXPLAINER_CACHE": str(cache)}
    rows = {"first_conversion": cli("describe", env=env)}
    target = _target(cache)
    pristine = work / "pristine"
    shutil.copytree(target, pristine)
    rows["permissions"] = {
        "folder": oct(target.stat().st_mode & 0o777),
        "files": sorted({oct(p.stat().st_mode & 0o777) for p in target.iterdir()}),
    }
    for kind in CACHE_FAULTS:
        shutil.rmtree(target)
        shutil.copytree(pristine, target)
        _damage(kind, target)
        row = cli("describe", env=env)
        row["next_start"] = cli("describe", env=env)
        rows[kind] = row
    return rows


def killed_conversion(work: Path) -> Row:
    """SIGKILL a first start while it writes the converted weights; start again; is the staging folder gone?"""
    cache = work / "cache-killed"
    env = {**ENV, "ATTENTION_EXPLAINER_CACHE": str(cache)}
    process = subprocess.Popen(
        [*CLI, "describe"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    staging: list[Path] = []
    deadline = time.monotonic() + 300
    while not staging and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
        found = (cache / "gguf").glob(".converting-*/model.safetensors") if (cache / "gguf").is_dir() else []
        staging = [p.parent for p in found if p.stat().st_size > 0]
    process.send_signal(signal.SIGKILL)
    process.wait()
    size = sum(p.stat().st_size for p in staging[0].iterdir()) if staging and staging[0].exists() else 0
    row = cli("describe", env=env)
    row.update(staging_bytes_left=size, staging_removed=bool(staging) and not staging[0].exists())
    return row


def concurrent_first_starts(work: Path) -> Row:
    """Two first starts at once on an empty cache: both answer, and the model is converted once."""
    env = {**ENV, "ATTENTION_EXPLAINER_CACHE": str(work / "cache-concurrent")}
    start = time.perf_counter()
    processes = [
        subprocess.Popen(
            [*CLI, "describe"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600)[1] for p in processes]
    return {
        "exits": [p.returncode for p in processes],
        "conversions": sum(dequantisations(o) for o in outputs),
        "traceback": any("Traceback" in o for o in outputs),
        "seconds": round(time.perf_counter() - start, 1),
    }


# --- the command line ---------------------------------------------------------------------------------------
def cli_faults(work: Path) -> dict[str, Row]:
    """Deep JSON, unwritable --out folders, a --png in a missing folder, a read-only cache, 100k layers."""
    deep = work / "deep.json"
    deep.write_text('{"text": ' + "[" * 10_000 + "]" * 10_000 + "}")
    layers = work / "layers.json"
    layers.write_text(json.dumps({"text": SHORT, "layers": list(range(30)) * 3334}))
    a_file = work / "a-file"
    a_file.write_text("x")
    rows = {
        "deep_json_10000": cli("call", "show_attention", "--json", f"@{deep}"),
        "analyze_out_is_a_file": cli("analyze", SHORT, "--out", str(a_file)),
        "analyze_out_read_only_fs": cli("analyze", SHORT, "--out", "/sys/kernel/attention-report"),
        "show_png_missing_folder": cli("show", SHORT, "--layer", "0", "--head", "0", "--png", "/nonexistent/dir/x.png"),
        "layers_100k_items": cli("call", "diagnose_collapse", "--json", f"@{layers}"),
        "read_only_cache": cli("describe", env={**ENV, "ATTENTION_EXPLAINER_CACHE": "/sys/attention-explainer-cache"}),
    }
    rows["show_png_missing_folder"]["created"] = Path("/nonexistent").exists()
    return rows


# --- MCP over stdio -------------------------------------------------------------------------------------------
class Stdio:
    """An MCP server process driven with raw JSON lines, as any client writes them."""

    def __init__(self, *options: str, env: dict[str, str] | None = None, log: Path) -> None:
        self.log = log
        self._errlog = log.open("w")
        command = [*CLI, "--artifacts", str(log.parent / "artifacts"), "mcp", *options]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errlog, env=env or ENV, cwd=ROOT
        )
        self.next_id = 1000
        self.stray: list[dict[str, Any]] = []

    def send(self, line: bytes | dict[str, Any]) -> None:
        assert self.process.stdin is not None
        data = line if isinstance(line, bytes) else json.dumps(line).encode()
        self.process.stdin.write(data + b"\n")
        self.process.stdin.flush()

    def receive(self, timeout: float = 300) -> dict[str, Any]:
        assert self.process.stdout is not None
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            raise TimeoutError("no answer")
        line = self.process.stdout.readline()
        if not line:
            raise EOFError("the server closed its output")
        return json.loads(line)

    def until(self, request_id: int, timeout: float = 300) -> dict[str, Any]:
        """The answer to ``request_id``; answers to other ids on the way are kept in ``self.stray``."""
        while (message := self.receive(timeout)).get("id") != request_id or "method" in message:
            if "id" in message and "method" not in message:
                self.stray.append(message)
        return message

    def request(self, method: str, params: dict[str, Any] | None = None, timeout: float = 300) -> dict[str, Any]:
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, **({"params": params} if params else {})})
        return self.until(self.next_id, timeout)

    def start(self) -> float:
        began = time.perf_counter()
        self.request("initialize", INITIALIZE)
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return round(time.perf_counter() - began, 1)

    def close(self) -> int | None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            return self.process.wait(timeout=60)
        finally:
            self._errlog.close()


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


MALFORMED: dict[str, bytes] = {
    "truncated_line": b'{"jsonrpc": "2.0", "id": 7, "method": "tools/li',
    "batch_array": b'[{"jsonrpc": "2.0", "id": 7, "method": "tools/list"}]',
    "missing_jsonrpc": b'{"id": 7, "method": "tools/list"}',
    "params_a_string": b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": "x"}',
    "object_id": b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "tools/list"}',
    "deep_nesting_10000": b'{"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {"x": '
    + b"[" * 10_000
    + b"]" * 10_000
    + b"}}",
    "unknown_method": b'{"jsonrpc": "2.0", "id": 7, "method": "tools/destroy"}',
    "invalid_utf8": b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "caf\xe9"}}',
}


def stdio_faults(work: Path, *, quick: bool = False) -> dict[str, Any]:
    """Malformed JSON-RPC, three cancellations, 100k layers, an 8,031-token call past --call-timeout 10 (not
    ``quick``)."""
    server = Stdio(
        "--call-timeout", "10", env={**ENV, "ATTENTION_EXPLAINER_CACHE": str(work / "cache")}, log=work / "stdio.log"
    )
    rows: dict[str, Any] = {"initialize_seconds": server.start()}
    for name, line in MALFORMED.items():
        server.send(line)
        answer = server.receive(60)
        rows[name] = {"code": answer.get("error", {}).get("code"), "id": answer.get("id")}
    cancels = []
    for attempt in range(3):
        request_id = 50 + attempt
        params = {**_call("diagnose_collapse", {"text": LONG}), "_meta": {"progressToken": f"p{attempt}"}}
        server.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})
        server.receive()  # the first progress notification: the work is under way
        server.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id}})
        began = time.perf_counter()
        server.stray.clear()
        after = server.request("tools/call", _call("show_attention", {"text": SHORT, "layer": 3, "head": 0}))
        answered = [m for m in server.stray if m.get("id") == request_id]  # MCP 2.x: none (the protocol's rule)
        cancels.append({"cancelled_call_answered": bool(answered), "next_call_ok": not after["result"]["isError"],
                        "next_call_seconds": round(time.perf_counter() - began, 2)})  # fmt: skip
    rows["cancellations"] = cancels
    began = time.perf_counter()
    big = server.request("tools/call", _call("diagnose_collapse", {"text": SHORT, "layers": list(range(30)) * 3334}))
    rows["layers_100k_items"] = {"seconds": round(time.perf_counter() - began, 2), "text": _text(big)[:120]}
    if not quick:
        began = time.perf_counter()
        slow = server.request("tools/call", _call("diagnose_collapse", {"text": VERY_LONG}))
        rows["call_past_timeout"] = {"seconds": round(time.perf_counter() - began, 1), "text": _text(slow)[:120]}
    began = time.perf_counter()
    after = server.request("tools/call", _call("show_attention", {"text": SHORT, "layer": 3, "head": 0}))
    rows["after_timeout"] = {"ok": not after["result"]["isError"], "seconds": round(time.perf_counter() - began, 2)}
    rows["alive"] = server.process.poll() is None
    rows["exit"] = server.close()
    log = server.log.read_text()
    rows["stopped_log_lines"] = log.count(" stopped after ")
    rows["traceback"] = "Traceback" in log
    return rows


def _text(answer: dict[str, Any]) -> str:
    result = answer.get("result") or {}
    content = result.get("content") or [{}]
    return str(content[0].get("text", answer.get("error")))


def bad_cache_server(work: Path) -> Row:
    """A server whose default model cannot load: does it answer initialize, say why, and exit when told?"""
    from agent_tools.loading import resolve_reference

    source = resolve_reference(None).path
    assert source is not None
    broken = work / "broken.gguf"
    with source.open("rb") as handle:
        broken.write_bytes(handle.read(1 << 20))
    server = Stdio("--model", str(broken), env={**ENV, "ATTENTION_EXPLAINER_CACHE": str(work / "cache-broken")},
                   log=work / "broken.log")  # fmt: skip
    row: Row = {"initialize_seconds": server.start()}
    answer = server.request("tools/call", _call("show_attention", {"text": SHORT, "layer": 3, "head": 0}))
    row["tool_error"] = _text(answer)[:160]
    row["exit_on_stdin_close"] = server.close()
    log = server.log.read_text()
    row["log_lines_about_it"] = log.count("did not load")
    row["traceback"] = "Traceback" in log
    return row


# --- MCP over HTTP --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


@contextmanager
def http_server(work: Path, *options: str, private_cache: bool = True) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An HTTP server on a free loopback port; its conversion cache the run's private one, or (not
    ``private_cache``: the soak, which damages nothing) the user's."""
    port = _free_port()
    log = (work / f"http-{port}.log").open("w")
    command = [*CLI, "--artifacts", str(work / "artifacts"), "mcp", "--transport", "streamable-http"]
    env = {**ENV, "ATTENTION_EXPLAINER_CACHE": str(work / "cache")} if private_cache else ENV
    process = subprocess.Popen([*command, "--port", str(port), *options], env=env, cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the HTTP server did not start") from None
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/mcp", process
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def idle_sessions(work: Path, attempts: int = 500) -> Row:
    """Open ``attempts`` sessions that are never closed: how many are admitted, RSS, and after the idle time."""
    import httpx

    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INITIALIZE}
    with http_server(work, "--max-sessions", "64", "--session-idle", "5") as (url, process):
        with httpx.Client(timeout=60) as client:
            client.post(url, json=body, headers=headers)
            time.sleep(6)
            before = rss_mib(process.pid)
            codes = [client.post(url, json=body, headers=headers).status_code for _ in range(attempts)]
            during = rss_mib(process.pid)
            time.sleep(7)
            reopened = client.post(url, json=body, headers=headers).status_code
        return {
            "attempts": attempts,
            "admitted": codes.count(200),
            "refused_503": codes.count(503),
            "rss_mib_before": before,
            "rss_mib_with_64_open": during,
            "after_idle_new_session": reopened,
            "rss_mib_after_idle": rss_mib(process.pid),
        }


CALL_MIX: list[tuple[str, dict[str, Any]]] = [
    ("show_attention", {"text": SHORT, "layer": 3, "head": 0}),
    ("diagnose_collapse", {"text": SHORT, "layers": [0, 3, 7], "top_k": 3}),
    ("ablate_heads", {"text": SHORT, "heads": ["3.0", "5.2"]}),
    ("attention_rollout", {"text": SHORT}),
    ("explain_scaling", {"text": SHORT, "layer": 3, "head": 0, "synthetic": False}),
    ("show_attention", {"text": SHORT, "layer": 99, "head": 0}),  # an error, every time the same
    ("reconstruct_attention", {"text": SHORT, "layer": 3, "head": 0}),
]


def _comparable(result: Any) -> str:
    """A call's answer without its timing: the structured content, or the error text."""
    structured = dict(result.structured_content or {})
    structured.pop("seconds_per_token", None)
    text = [c.text for c in result.content if getattr(c, "text", None)] if result.is_error else None
    return json.dumps({"error": result.is_error, "structured": structured, "text": text}, sort_keys=True)


async def _serial_reference(url: str) -> list[str]:
    """Every call of the mix once, one after another (the reference), then one cancelled long call, so the RSS
    measured next already includes a long call's working set."""
    from mcp import Client

    async with Client(url, mode="legacy") as client:
        reference = [_comparable(await client.call_tool(name, args)) for name, args in CALL_MIX]
        await _cancelled_call(client)
        return reference


async def _cancelled_call(client: Any) -> str:
    """A long call, cancelled as soon as its first progress notification arrives (cancelling the call's task
    sends ``notifications/cancelled``): "cancelled", or "answered" when the answer came first."""
    import anyio

    started = anyio.Event()
    outcome = "cancelled"  # stays so unless the call is answered: MCP 2.x sends no answer to a cancelled request

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    async def long_call() -> None:
        nonlocal outcome
        await client.call_tool("diagnose_collapse", {"text": LONG}, progress_callback=on_progress)
        outcome = "answered"

    async with anyio.create_task_group() as group:
        group.start_soon(long_call)
        with anyio.fail_after(600):
            await started.wait()
        group.cancel_scope.cancel()
    return outcome


async def _worker(url: str, jobs: list[int], reference: list[str], tally: dict[str, int]) -> None:
    from mcp import Client

    async with Client(url, mode="legacy") as client:
        while jobs:
            index = jobs.pop()
            try:
                await _one_call(client, index, reference, tally)
            except Exception as exc:  # a dropped session or a transport error: what this run is looking for
                tally["failed"] += 1
                EXAMPLES.setdefault("failed", f"{type(exc).__name__}: {exc}"[:300])


async def _one_call(
    client: Any, index: int, reference: list[str], tally: dict[str, int], *, fresh: bool = False
) -> None:
    """Call ``index`` of the run: every 20th a cancelled long call; with ``fresh`` every odd one a text never sent
    before (its answer must not be an error); otherwise the mix's call, compared with the serial answer."""
    if index % 20 == 19:
        outcome = await _cancelled_call(client)
        tally["cancelled" if outcome == "cancelled" else "cancel_not_honoured"] += 1
        return
    name, args = CALL_MIX[index % len(CALL_MIX)]
    if fresh and index % 2 == 1 and name != "show_attention":
        result = await client.call_tool(name, {**args, "text": f"{SHORT} Call {index} said {index * 7919 % 1000}."})
        tally[_outcome(result) or "fresh_text_ok"] += 1
        return
    result = await client.call_tool(name, args)
    same = _comparable(result) == reference[index % len(CALL_MIX)]
    kind = "same_as_serial" if same else _outcome(result) or "different"
    tally[kind] += 1
    if kind != "same_as_serial":
        EXAMPLES.setdefault(kind, f"{name}: {_comparable(result)[:300]}")


EXAMPLES: dict[str, str] = {}  # the first answer of each kind that is not the serial one (what the tally counts)


def _outcome(result: Any) -> str | None:
    """None for an answer; "deadline_exceeded" for a call past the server's --call-timeout (its queue behind the
    model's lock is part of the call); "tool_error" for any other error."""
    if not result.is_error:
        return None
    text = " ".join(getattr(c, "text", "") for c in result.content)
    return "deadline_exceeded" if "[deadline_exceeded]" in text else "tool_error"


TALLY = (
    "same_as_serial",
    "different",
    "fresh_text_ok",
    "tool_error",
    "deadline_exceeded",
    "cancelled",
    "cancel_not_honoured",
    "failed",
)


def http_run(work: Path, calls: int, concurrency: int = 8) -> Row:
    """``calls`` calls from ``concurrency`` sessions, every 20th cancelled mid-call; deaths, equality, RSS."""
    import anyio

    with http_server(work) as (url, process):
        reference = anyio.run(_serial_reference, url)
        rss_start = rss_mib(process.pid)
        tally = dict.fromkeys(TALLY, 0)
        jobs = list(range(calls))[::-1]
        samples: list[tuple[int, float]] = []  # (calls done, RSS MiB): does memory level off?
        began = time.perf_counter()

        async def sample() -> None:
            while True:
                await anyio.sleep(5)
                samples.append((calls - len(jobs), rss_mib(process.pid)))

        async def run_all() -> None:
            async with anyio.create_task_group() as group:
                group.start_soon(sample)
                async with anyio.create_task_group() as workers:
                    for _ in range(concurrency):
                        workers.start_soon(_worker, url, jobs, reference, tally)
                group.cancel_scope.cancel()

        anyio.run(run_all)
        alive = process.poll() is None
        return {
            "calls": calls,
            "concurrency": concurrency,
            **tally,
            "server_deaths": 0 if alive else 1,
            "rss_mib_start": rss_start,
            "rss_mib_end": rss_mib(process.pid) if alive else None,
            "rss_mib_by_calls": samples[:: max(1, len(samples) // 12)],
            "examples": dict(EXAMPLES),
            "seconds": round(time.perf_counter() - began, 1),
        }


# --- the soak -----------------------------------------------------------------------------------------------
PLATEAU_GROWTH = 0.05  # RSS plateaus when its last third grows it by less than this
SESSION_CALLS = 50  # a soak client opens a new session after this many calls (sessions come and go, as in use)


SAMPLE_EVERY_S = 10.0


def soak(work: Path, minutes: float, concurrency: int = 8, every: float = SAMPLE_EVERY_S) -> Row:
    """``concurrency`` clients calling for ``minutes``; the server's RSS every ``every`` seconds; does it plateau?"""
    import itertools

    import anyio
    from mcp import Client

    with http_server(work, private_cache=False) as (url, process):
        reference = anyio.run(_serial_reference, url)
        tally = dict.fromkeys(TALLY, 0)
        indices = itertools.count()
        samples: list[tuple[float, int, float]] = []  # (minutes, calls done, RSS MiB)
        began = time.perf_counter()
        stop_at = began + minutes * 60

        def calls_done() -> int:
            return sum(tally.values())

        async def client_loop() -> None:
            while time.perf_counter() < stop_at:
                try:
                    async with Client(url, mode="legacy") as client:
                        for _ in range(SESSION_CALLS):
                            if time.perf_counter() >= stop_at:
                                break
                            await _one_call(client, next(indices), reference, tally, fresh=True)
                except Exception as exc:  # a dropped session or a transport error: what the soak is looking for
                    tally["failed"] += 1
                    EXAMPLES.setdefault("failed", f"{type(exc).__name__}: {exc}"[:300])

        async def sample() -> None:
            while True:
                samples.append((round((time.perf_counter() - began) / 60, 2), calls_done(), rss_mib(process.pid)))
                print(f"   soak {samples[-1]}", file=sys.stderr, flush=True)
                await anyio.sleep(every)

        async def run_all() -> None:
            async with anyio.create_task_group() as group:
                group.start_soon(sample)
                async with anyio.create_task_group() as clients:
                    for _ in range(concurrency):
                        clients.start_soon(client_loop)
                group.cancel_scope.cancel()

        anyio.run(run_all)
        alive = process.poll() is None
        if alive:
            samples.append((round((time.perf_counter() - began) / 60, 2), calls_done(), rss_mib(process.pid)))
    return {"minutes": minutes, "concurrency": concurrency, **tally, "server_deaths": 0 if alive else 1,
            "examples": dict(EXAMPLES), "samples": samples, **plateau(samples)}  # fmt: skip


def plateau(samples: list[tuple[float, int, float]]) -> Row:
    """RSS at the start of the run's last third and at its end, the growth between, and whether it is < 5 %."""
    if len(samples) < 3:
        return {"plateaus": None}
    end = samples[-1]
    two_thirds = next(s for s in samples if s[0] >= end[0] * 2 / 3)
    growth = (end[2] - two_thirds[2]) / two_thirds[2]
    return {"rss_mib_first": samples[0][2], "rss_mib_two_thirds": two_thirds[2], "rss_mib_end": end[2],
            "last_third_growth": round(growth, 4), "plateaus": growth < PLATEAU_GROWTH}  # fmt: skip


def _every_nth(samples: list[Any], rows: int) -> list[Any]:
    """About ``rows`` of the samples, evenly spaced, the last one always included."""
    shown = samples[:: max(1, -(-len(samples) // rows))]
    return shown if shown[-1] is samples[-1] else [*shown, samples[-1]]


def soak_table(row: Row, command: str) -> str:
    """The soak's result as Markdown: the machine, the RSS samples, the counts and the verdict with its rule."""
    load = os.getloadavg()
    lines = [
        f"# Soak: {row['minutes']:g} minutes, {row['concurrency']} MCP HTTP clients",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores "
        f"(load average at the end {load[0]:.1f}), the default model. Each client calls the mixed tools "
        f"(show_attention, diagnose_collapse, ablate_heads, attention_rollout, explain_scaling, "
        f"reconstruct_attention, an out-of-range layer), every other one on a text never sent before, every 20th "
        f"a long diagnose_collapse cancelled at its first progress report, and opens a new session every "
        f"{SESSION_CALLS} calls.",
        "",
        f"The server's RSS, sampled every {SAMPLE_EVERY_S:g} s ({len(row['samples'])} samples, about 16 shown):",
        "",
        "| minute | calls done | server RSS (MiB) |",
        "|---:|---:|---:|",
        *[f"| {m:.2f} | {calls} | {rss:.1f} |" for m, calls, rss in _every_nth(row["samples"], 16)],
        "",
        "| count | value |",
        "|---|---:|",
        *[f"| {name} | {row[name]} |" for name in (*TALLY, "server_deaths")],
        "",
        *[f"- first `{kind}`: `{example}`" for kind, example in row.get("examples", {}).items()],
        "",
    ]
    if row.get("plateaus") is not None:
        verdict = "plateaus" if row["plateaus"] else "does NOT plateau"
        lines.append(
            f"RSS {row['rss_mib_first']:.1f} MiB at the start, {row['rss_mib_two_thirds']:.1f} MiB at two thirds, "
            f"{row['rss_mib_end']:.1f} MiB at the end: the last third grew it by "
            f"{100 * row['last_third_growth']:.1f} %, "
            f"so it **{verdict}** (rule: the last third grows RSS by less than {100 * PLATEAU_GROWTH:g} %)."
        )
    return "\n".join(lines) + "\n"


# --- the run ------------------------------------------------------------------------------------------------
def timed(name: str, step: Callable[[], Any], results: dict[str, Any]) -> None:
    began = time.perf_counter()
    print(f"== {name} ...", file=sys.stderr, flush=True)
    try:
        results[name] = step()
    except Exception as exc:  # a fault the catalogue did not expect is itself a finding
        results[name] = {"catalogue_error": f"{type(exc).__name__}: {exc}"}
    print(f"   {time.perf_counter() - began:.0f} s: {json.dumps(results[name])[:400]}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls in the 8-way HTTP run (default: %(default)s)")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    parser.add_argument("--skip-cache", action="store_true", help="leave out the cache faults (each rebuilds ~20 s)")
    parser.add_argument("--quick", action="store_true", help="no cache faults, no 8,031-token call, 40 HTTP calls")
    parser.add_argument("--soak-minutes", type=float, nargs="?", const=30.0, default=None,
                        help="run only the soak, for N minutes (default N: 30)")  # fmt: skip
    parser.add_argument("--table", default=str(ROOT / "benchmarks" / "results-soak.md"),
                        help="where the soak writes its Markdown table (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    if args.soak_minutes is not None:
        with tempfile.TemporaryDirectory(prefix="fault-soak-") as folder:
            timed("soak", lambda: soak(Path(folder), args.soak_minutes), results)
        print(json.dumps(results, indent=2))
        if "samples" in results["soak"]:
            command = f"scripts/fault_catalogue.py --soak-minutes {args.soak_minutes:g}"
            Path(args.table).write_text(soak_table(results["soak"], command))
        return 0
    if args.quick:
        args.skip_cache, args.calls = True, min(args.calls, 40)
    with tempfile.TemporaryDirectory(prefix="fault-catalogue-") as folder:
        work = Path(folder)
        if not args.skip_cache:
            timed("cache_faults", lambda: cache_faults(work), results)
            timed("killed_conversion", lambda: killed_conversion(work), results)
            timed("concurrent_first_starts", lambda: concurrent_first_starts(work), results)
        else:
            cli("describe", env={**ENV, "ATTENTION_EXPLAINER_CACHE": str(work / "cache")})
        timed("cli_faults", lambda: cli_faults(work), results)
        timed("stdio_faults", lambda: stdio_faults(work, quick=args.quick), results)
        timed("bad_cache_server", lambda: bad_cache_server(work), results)
        timed("idle_http_sessions", lambda: idle_sessions(work, 100 if args.quick else 500), results)
        timed("http_run", lambda: http_run(work, args.calls), results)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
