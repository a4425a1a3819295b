"""Corpus runs: readers, rows equal to the single-prompt tools, aggregation by hand, identical engines (a local
Ray started here), a killed run resumed, bad rows and bad input, and the corpus_summary tool's allow-list."""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil
import pyarrow.parquet as pq
import pytest
import torch
from families import build_family, tiny_tokenizer

from agent_tools.analysis.heads import TEXT_ROLES
from agent_tools.cli import build_parser, main, session_from_args
from agent_tools.corpus import run_corpus
from agent_tools.corpus.aggregate import bootstrap_interval, summarise
from agent_tools.corpus.flow import TooManyErrors
from agent_tools.corpus.ray_engine import ActorsKeptDying, RayOptions
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import ModelPolicy
from agent_tools.runs.items import read_items
from agent_tools.tools import get_tool

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "the cat sat on the mat .",
    "the dog was tired , and it sat on the mat",
    "a cat is on the mat because it was tired",
    "he and she sat in the dog mat",
    "they sat . the cat was tired",
    "it is the cat of the dog , and the mat",
]
CHATS = [
    [{"role": "system", "content": "The secret code is 4721."}, {"role": "user", "content": "What is the code?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is the capital of Italy?"}],
    [{"role": "user", "content": "Name a colour of the sky."}],
]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def nan_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return bool(a == b)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama saved with save_pretrained: loadable by path in this process, a subprocess, an actor."""
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    build_family("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture()
def session(tiny: str) -> Inspector:
    return Inspector(policy=ModelPolicy(frozenset({tiny}), tiny), token_limit=20)


# --- readers --------------------------------------------------------------------------------------------------
def test_jsonl_parquet_and_datasets_folder_give_the_same_items(tmp_path: Path) -> None:
    import datasets

    records = [{"text": TEXTS[0], "id": "a"}, {"messages": CHATS[2], "id": "b"}, {"text": TEXTS[1], "id": "c"}]
    jsonl = write_jsonl(tmp_path / "d.jsonl", [*records[:2], "", "{not json", 7, {"id": "x"}, records[2]])
    items = list(read_items(jsonl))
    assert [i.index for i in items] == [0, 1, 2, 3, 4, 5]  # the blank line is no item
    assert [i.problem is None for i in items] == [True, True, False, False, False, True]
    assert items[2].problem.startswith("line 4 is not valid JSON")
    assert items[3].problem == "record is a int, not an object with text or messages"
    assert items[4].problem == "record has neither of 'text' and 'messages'; give exactly one"
    frame = pd.DataFrame(records)
    frame.to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_pandas(frame).save_to_disk(str(tmp_path / "ds"))
    for path in (tmp_path / "d.parquet", tmp_path / "ds"):
        read = list(read_items(path))
        assert [(i.id, i.text, i.messages) for i in read] == [
            (r["id"], r.get("text"), r.get("messages")) for r in records
        ]


# --- rows equal the single-prompt tools ------------------------------------------------------------------------
def test_profile_rows_equal_profile_heads_and_diagnose_collapse(tmp_path: Path, session: Inspector, tiny: str) -> None:
    long_text = " ".join(["the cat sat on the mat"] * 6)  # 37 tokens, over the session's token limit of 20
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS[:3]] + [{"text": " "}, {"text": long_text}])
    result = run_corpus("profile", data, out=tmp_path / "out", inspector=session, progress=False)
    facts = session.model(tiny).facts
    table = result.table
    assert len(table) == 3 * facts.num_layers * facts.num_heads and sorted(set(table["item"])) == [0, 1, 2]
    assert result.errors[["item", "kind"]].values.tolist() == [[3, "invalid_input"], [4, "resource_limit"]]
    assert "accepts at most 20 tokens" in result.errors["reason"].iloc[1]
    for index, text in enumerate(TEXTS[:3]):
        full = get_tool("profile_heads")(session, {"text": text})  # every role: the text roles' scores are the same
        same_roles = get_tool("profile_heads")(session, {"text": text, "roles": list(TEXT_ROLES)})
        collapse = {
            (r.layer, r.head): r for r in get_tool("diagnose_collapse")(session, {"text": text, "top_k": 50}).heads
        }
        rows = table[table["item"] == index].set_index(["layer", "head"])
        for head, same in zip(full.heads, same_roles.heads, strict=True):
            row = rows.loc[(head.layer, head.head)]
            assert all(nan_equal(row[f"score_{r}"], head.scores.get(r)) for r in TEXT_ROLES)
            assert (row["primary_role"], row["confidence"]) == (same.primary_role, same.confidence)
            stats = collapse[(head.layer, head.head)]
            assert (row["verdict"], row["mean_max_weight"], row["sink_fraction"]) == (
                stats.verdict,
                stats.mean_max_weight,
                stats.sink_fraction,
            )
            assert row["collapsed"] == (stats.verdict != "not_collapsed")
    on_disk = pq.read_table(tmp_path / "out" / "table.parquet")
    assert (
        on_disk.equals(result.arrow) and json.loads((tmp_path / "out" / "summary.json").read_text()) == result.summary
    )


def test_collapse_rows_equal_every_field_of_diagnose_collapse(tmp_path: Path, session: Inspector) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": TEXTS[3]}])
    table = run_corpus("collapse", data, out=tmp_path / "out", inspector=session, progress=False).table
    report = get_tool("diagnose_collapse")(session, {"text": TEXTS[3], "top_k": 50})
    assert len(table) == report.heads_examined == len(report.heads)
    rows = table.set_index(["layer", "head"])
    for head in report.heads:
        row = rows.loc[(head.layer, head.head)]
        assert all(
            nan_equal(row[name], value) for name, value in head.model_dump().items() if name not in ("layer", "head")
        )


@pytest.mark.real_model
def test_trace_rows_equal_trace_prompt_attention_and_aggregate_by_kind(tmp_path: Path) -> None:
    session = Inspector()
    named = {"messages": CHATS[0], "segments": [{"name": "code", "text": "4721", "message": 0}]}
    data = write_jsonl(tmp_path / "d.jsonl", [named, {"messages": CHATS[1]}, {"messages": CHATS[2]}, {"messages": []}])
    result = run_corpus("trace", data, out=tmp_path / "out", inspector=session, progress=False)
    table = result.table
    assert result.errors[["item", "kind"]].values.tolist() == [[3, "invalid_input"]]
    for index, record in enumerate([named, {"messages": CHATS[1]}, {"messages": CHATS[2]}]):
        arguments = {"prompt": record["messages"], **({"segments": record["segments"]} if "segments" in record else {})}
        report = get_tool("trace_prompt_attention")(session, arguments)
        rows = table[table["item"] == index]
        assert rows["segment"].tolist() == [s.name for s in report.segments]
        for segment, (_, row) in zip(report.segments, rows.iterrows(), strict=True):
            assert (row["share"], row["last_layer_share"], row["token_count"]) == (
                segment.share,
                segment.last_layer_share,
                segment.token_count,
            )
            assert nan_equal(row["share_without_sink"], segment.share_without_sink)
            assert row["read_most"] == (segment.name == report.read_most)
    assert "code" in set(table["segment"])
    kinds = {row["kind"]: row for row in result.summary["kinds"]}
    system = table[table["kind"] == "system"].groupby("item")["read_most"].max()
    assert kinds["system"]["items"] == 2 and kinds["system"]["read_most_rate"]["mean"] == pytest.approx(system.mean())
    user_share = table[table["kind"] == "user"].groupby("item")["share"].sum()
    assert kinds["user"]["metrics"]["share"]["mean"] == pytest.approx(user_share.mean(), abs=1e-6)


# --- aggregation, by hand --------------------------------------------------------------------------------------
def test_summary_numbers_by_hand() -> None:
    # head 0.0: previous_token on 4 of 5 items (stable); head 0.1: 3 of 5 (variable); scores chosen by hand
    roles = {(0, 0): ["previous_token"] * 4 + [None], (0, 1): ["self", "self", "self", "broad", "broad"]}
    scores = {(0, 0): [0.9, 0.8, 0.7, 0.6, 0.5], (0, 1): [0.2, 0.2, 0.2, 0.2, 0.2]}
    rows = [
        {"item": item, "layer": 0, "head": head, "primary_role": roles[(0, head)][item],
         "score_self": scores[(0, head)][item], "collapsed": item == 0 and head == 1}
        for item in range(5) for head in (0, 1)
    ]  # fmt: skip
    errors = pd.DataFrame([{"item": 5, "id": None, "kind": "malformed", "reason": "line 6 is not valid JSON"}])
    summary = summarise("profile", pd.DataFrame(rows), errors, resamples=200, seed=3)
    assert (summary["items"], summary["analysed"], summary["errors"]) == (6, 5, 1)
    first, second = summary["heads"]
    assert (first["role"], first["role_share"], first["stable"]) == ("previous_token", 0.8, True)
    assert (second["role"], second["role_share"], second["stable"]) == ("self", 0.6, False)
    assert second["roles"] == {"self": 0.6, "broad": 0.4}
    stats = first["metrics"]["score_self"]
    assert stats["mean"] == pytest.approx(0.7) and stats["std"] == pytest.approx(
        np.std([0.9, 0.8, 0.7, 0.6, 0.5]), abs=1e-6
    )
    assert stats["ci_low"] <= 0.7 <= stats["ci_high"] and stats["ci_low"] >= 0.5 and stats["ci_high"] <= 0.9
    constant = second["metrics"]["score_self"]
    assert (constant["ci_low"], constant["ci_high"]) == (0.2, 0.2)
    assert second["metrics"]["collapsed"]["mean"] == pytest.approx(0.2)
    assert summary["stable_heads"] == [{"head": "0.0", "role": "previous_token", "share": 0.8}]
    assert [h["head"] for h in summary["variable_heads"]] == ["0.1"]
    assert summary == summarise("profile", pd.DataFrame(rows), errors, resamples=200, seed=3)  # fixed seed


def test_bootstrap_interval_skips_missing_values() -> None:
    values = np.array([[1.0, np.nan], [3.0, 2.0], [5.0, np.nan], [7.0, 2.0]])
    low, high = bootstrap_interval(values, resamples=500, seed=0)
    assert 1.0 <= low[0] < 4.0 < high[0] <= 7.0
    assert (low[1], high[1]) == (2.0, 2.0)


# --- engines ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_local_and_ray_engines_give_identical_tables(tmp_path: Path, session: Inspector) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS] + ["{oops"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray actor runs (one CPU thread): the same kernels, the same sums
    try:
        local = run_corpus("profile", data, out=tmp_path / "local", inspector=session, batch_size=2, progress=False)
    finally:
        torch.set_num_threads(threads)
    ray_run = run_corpus(
        "profile", data, out=tmp_path / "ray", engine="ray", inspector=session, batch_size=2, progress=False,
        ray_options=RayOptions(actors=2),
    )  # fmt: skip
    assert local.arrow.num_rows == 6 * 2 * 4 and local.arrow.equals(ray_run.arrow)
    assert local.arrow_errors.equals(ray_run.arrow_errors) and local.summary == ray_run.summary
    assert len(list((tmp_path / "ray" / "parts").glob("*.done.json"))) >= 2  # written as the batches came back


def _local_table(data: Path, out: Path, session: Inspector) -> Any:
    """The uninterrupted run, on one CPU thread as each Ray actor runs (the same kernels, the same sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_corpus("profile", data, out=out, inspector=session, batch_size=1, progress=False)
    finally:
        torch.set_num_threads(threads)


class ActorKiller(threading.Thread):
    """SIGKILLs this test's Ray actor processes (as an OOM killer would) once the run has committed a part: one
    actor once, or (``every``) every actor, replacements too, until stopped. Only descendants of this process:
    another session's Ray is not ours."""

    def __init__(self, parts: Path, *, every: bool) -> None:
        super().__init__(daemon=True)
        self.parts, self.every = parts, every
        self.killed: list[int] = []
        self.stopped = threading.Event()

    @staticmethod
    def actors() -> list[psutil.Process]:
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if "CorpusActor" in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.Error:
                continue
        return found

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            if not list(self.parts.glob("*.done.json")):
                continue
            for actor in self.actors()[: None if self.every else 1]:
                try:
                    os.kill(actor.pid, signal.SIGKILL)
                    self.killed.append(actor.pid)
                except ProcessLookupError:
                    continue
            if self.killed and not self.every:
                return


@pytest.mark.slow
def test_a_ray_actor_killed_mid_run_is_replaced_and_the_table_equals_an_uninterrupted_one(
    tmp_path: Path, session: Inspector, caplog: pytest.LogCaptureFixture
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS + TEXTS[::-1]])
    whole = _local_table(data, tmp_path / "whole", session)
    killer = ActorKiller(tmp_path / "ray" / "parts", every=False)
    killer.start()
    try:
        with caplog.at_level(logging.INFO, logger="agent_tools.corpus"):
            result = run_corpus(
                "profile", data, out=tmp_path / "ray", engine="ray", inspector=session, batch_size=1,
                progress=False, ray_options=RayOptions(actors=2, max_restarts=3),
            )  # fmt: skip
    finally:
        killer.stopped.set()
    assert len(killer.killed) == 1
    assert "a Ray actor died" in caplog.text and "restart 1 of at most 3" in caplog.text  # reported as it ran
    assert "12 of 12 items done, 1 actor restarts" in caplog.text
    assert result.complete and result.arrow.num_rows == 12 * 2 * 4 and result.arrow.equals(whole.arrow)
    covered = [i for m in (tmp_path / "ray" / "parts").glob("*.done.json") for i in json.loads(m.read_text())["items"]]
    assert sorted(covered) == list(range(12))  # the dead actor's item was retried once, not written twice


@pytest.mark.slow
def test_ray_actors_that_keep_dying_stop_the_run_with_a_clear_error_and_a_rerun_resumes(
    tmp_path: Path, session: Inspector
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS + TEXTS[::-1]])
    killer = ActorKiller(tmp_path / "ray" / "parts", every=True)
    killer.start()
    faulthandler.dump_traceback_later(600, exit=True)  # a hang fails the suite with the stacks, not blocks it
    try:
        with pytest.raises(ActorsKeptDying, match=r"3 actor deaths, more than max_restarts 2 .*a rerun continues"):
            run_corpus(
                "profile", data, out=tmp_path / "ray", engine="ray", inspector=session, batch_size=1,
                progress=False, ray_options=RayOptions(actors=2, max_restarts=2, max_task_retries=5),
            )  # fmt: skip
    finally:
        faulthandler.cancel_dump_traceback_later()
        killer.stopped.set()
    out = tmp_path / "ray"
    committed = len(list((out / "parts").glob("*.done.json")))
    manifest = json.loads((out / "run.json").read_text())
    assert 1 <= committed < 12 and manifest["complete"] is False
    assert pq.read_table(out / "table.parquet").num_rows == committed * 2 * 4  # what came back was kept
    resumed = _local_table(data, out, session)  # the rerun, here by the local engine (either engine resumes)
    whole = _local_table(data, tmp_path / "whole", session)
    assert resumed.complete and resumed.arrow.equals(whole.arrow)


def _corpus_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent_tools.cli", "corpus", *args, "--no-progress"]


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_table(tmp_path: Path, tiny: str) -> None:
    """SIGKILL a CLI run (a tiny saved model, so that the run is long in items, not in seconds) after two parts,
    rerun the same command: the table equals an uninterrupted run's, and no item was computed twice."""
    n = 30
    texts = [f"{TEXTS[i % 6]} {TEXTS[(i + 1) % 6]} number {i}." for i in range(n)]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts] + [{"text": ""}])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    killed = tmp_path / "killed"
    command = _corpus_cli("profile", str(data), "--out", str(killed), "--batch-size", "1", "--model", tiny)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list((killed / "parts").glob("*.done.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done_before = len(list((killed / "parts").glob("*.done.json")))
    assert 2 <= done_before < n + 1 and not (killed / "table.parquet").exists()  # killed mid-way
    assert subprocess.run(command, env=env, capture_output=True, timeout=300).returncode == 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess ran (OMP_NUM_THREADS=1): the same kernels, the same sums
    try:
        session = Inspector(policy=ModelPolicy(frozenset({tiny}), tiny))
        whole = run_corpus("profile", data, out=tmp_path / "whole", inspector=session, progress=False)
    finally:
        torch.set_num_threads(threads)
    resumed = pq.read_table(killed / "table.parquet")
    layers, heads = 2, 4
    assert resumed.num_rows == n * layers * heads and resumed.equals(whole.arrow)
    assert pq.read_table(killed / "errors.parquet").equals(whole.arrow_errors)
    covered = [i for m in (killed / "parts").glob("*.done.json") for i in json.loads(m.read_text())["items"]]
    assert sorted(covered) == list(range(n + 1))  # every item once: the rerun skipped what was done


# --- bad rows, bad input ---------------------------------------------------------------------------------------
def test_max_errors_stops_the_run_and_a_rerun_continues(tmp_path: Path, session: Inspector) -> None:
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"text": ""}, {"text": TEXTS[0]}, "{bad", {"text": "  "}, {"text": TEXTS[1]}]
    )
    with pytest.raises(TooManyErrors, match=r"stopped after 2 bad rows, more than --max-errors 1"):
        run_corpus("collapse", data, out=tmp_path / "out", inspector=session, max_errors=1, batch_size=10)
    manifest = json.loads((tmp_path / "out" / "run.json").read_text())
    assert manifest["complete"] is False and len(pq.read_table(tmp_path / "out" / "errors.parquet")) == 2
    result = run_corpus("collapse", data, out=tmp_path / "out", inspector=session, progress=False)
    assert (
        result.complete and sorted(result.errors["item"]) == [0, 2, 3] and sorted(set(result.table["item"])) == [1, 4]
    )
    with pytest.raises(InvalidInputError, match="holds another run"):
        run_corpus("profile", data, out=tmp_path / "out", inspector=session)


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ")
    return err


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": TEXTS[0]}])
    out = str(tmp_path / "out")
    from agent_tools.cli.corpus import TASK_NAMES
    from agent_tools.corpus.tasks import TASKS

    assert TASK_NAMES == TASKS  # the CLI's help names every task without importing torch
    assert "unknown task 'roles'; tasks: profile, trace, collapse, kv_cache" in _one_line_error(
        capsys, ["corpus", "roles", str(data), "--out", out]
    )
    assert "does not exist" in _one_line_error(capsys, ["corpus", "profile", str(tmp_path / "none.jsonl")])
    (tmp_path / "d.csv").write_text("text\nhello\n")
    assert "unknown format" in _one_line_error(capsys, ["corpus", "profile", str(tmp_path / "d.csv")])
    monkeypatch.setattr("agent_tools.corpus.ray_engine.ray_available", lambda: False)
    assert "--engine ray needs Ray" in _one_line_error(
        capsys, ["corpus", "profile", str(data), "--engine", "ray", "--out", out]
    )
    assert not (tmp_path / "out").exists()  # refused before anything was written


# --- the corpus_summary tool and the page -----------------------------------------------------------------------
def test_corpus_summary_reads_only_allowed_data(tmp_path: Path, session: Inspector, tiny: str) -> None:
    data = write_jsonl(tmp_path / "chats.jsonl", [{"text": TEXTS[0]}, {"messages": CHATS[0]}, "{bad"])
    run = run_corpus("profile", data, out=tmp_path / "run", inspector=session, progress=False)
    allowed = Inspector(policy=session.policy, allowed_data=[data, tmp_path / "run"])
    tool = get_tool("corpus_summary")
    listing = tool(allowed, {})
    assert listing.kind == "list" and listing.allowed == ["chats.jsonl", "run"]
    report = tool(allowed, {"data": "run", "top_k": 3})
    assert (report.kind, report.task, report.items, report.analysed, report.errors) == ("run", "profile", 3, 1, 2)
    assert [h.head for h in report.stable_heads] == [h["head"] for h in run.summary["stable_heads"][:3]]
    assert report.stable_count == len(run.summary["stable_heads"]) and report.model == tiny
    facts = tool(allowed, {"data": "chats.jsonl"}).data_facts
    assert facts is not None and (facts.items, facts.text_items, facts.message_items, facts.unreadable) == (3, 1, 1, 1)
    assert facts.roles == {"system": 1, "user": 1}
    for name in ("/etc/passwd", str(tmp_path / "run" / "table.parquet"), "../chats.jsonl", "chats"):
        with pytest.raises(InvalidInputError, match=r"is not allowed here; allowed: chats.jsonl, run"):
            tool(allowed, {"data": name})
    with pytest.raises(InvalidInputError, match="no data files are allowed in this session"):
        tool(session, {"data": "chats.jsonl"})
    args = build_parser().parse_args(["--allow-data", str(data), "--allow-data", str(tmp_path / "run"), "tools"])
    assert session_from_args(args).allowed_data == (data.resolve(), (tmp_path / "run").resolve())
    page = (tmp_path / "run" / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert page.count('<td style="background') == 2 * 2 * 4  # two layer × head grids of the tiny model


# --- one run per folder (issue 29) -----------------------------------------------------------------------------
def _rows_once(table: pd.DataFrame) -> bool:
    return not table.duplicated(["item", "layer", "head"]).any()


def test_a_second_run_on_a_locked_folder_is_refused_at_once_naming_the_holder(
    tmp_path: Path, session: Inspector
) -> None:
    import socket

    from agent_tools.runs.store import RunStore

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "out"
    ran: list[object] = []
    with RunStore(out, {}, []).locked(), pytest.MonkeyPatch.context() as patch:  # a run in progress holds the lock
        patch.setattr("agent_tools.corpus.api.run_local", lambda run, items: ran.append(run))
        with pytest.raises(InvalidInputError) as refused:
            run_corpus("collapse", data, out=out, inspector=session, progress=False)
    assert ran == []  # refused before the engine started: no item ran
    holder = f"PID {os.getpid()} on host {socket.gethostname()}"
    assert f"is in use by another corpus run ({holder}); wait for it" in refused.value.message
    assert not (out / "run.json").exists()  # the refused run wrote nothing
    result = run_corpus("collapse", data, out=out, inspector=session, progress=False)  # the lock is free again
    assert result.complete and _rows_once(result.table)


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path: Path, session: Inspector) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS[:3]])
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out.mkdir()
    (out / ".run.lock").write_text("")
    (out / ".run.owner.json").write_text(json.dumps({"pid": int(dead.stdout), "host": "gone"}))
    result = run_corpus("collapse", data, out=out, inspector=session, progress=False)
    assert result.complete and sorted(set(result.table["item"])) == [0, 1, 2]
    assert not (out / ".run.owner.json").exists()  # the dead run's name is gone, and this run's went with its lock


def test_two_concurrent_runs_never_put_an_item_in_the_table_twice(tmp_path: Path, session: Inspector) -> None:
    """The issue's run: two runs started together on one folder covered 32 items 48 times. Now one is refused
    (or, if the first is done before the second starts, the second resumes a complete run): one table either way,
    equal to a single run's."""
    import threading

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS * 3])
    reference = run_corpus("collapse", data, out=tmp_path / "single", inspector=session, progress=False)
    out = tmp_path / "shared"
    start = threading.Barrier(2)
    outcomes: list[Any] = []

    def one_run() -> None:
        start.wait()
        try:
            outcomes.append(run_corpus("collapse", data, out=out, inspector=session, progress=False, batch_size=2))
        except InvalidInputError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=one_run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [o for o in outcomes if isinstance(o, InvalidInputError)]
    assert all("is in use by another corpus run (PID" in o.message for o in refused)
    final = pq.read_table(out / "table.parquet").to_pandas()
    assert _rows_once(final)
    pd.testing.assert_frame_equal(final, reference.table)


def test_a_folder_holding_an_item_twice_is_repaired_by_the_next_run(tmp_path: Path, session: Inspector) -> None:
    """A folder written without the lock (an older version) holds parts that cover the same items: the table keeps
    each item's first part, so a rerun gives the single run's table."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "out"
    reference = run_corpus("collapse", data, out=out, inspector=session, progress=False, batch_size=3).table
    for part in sorted((out / "parts").glob("part-000000.*")):
        (out / "parts" / part.name.replace("000000", "000007")).write_bytes(part.read_bytes())
    result = run_corpus("collapse", data, out=out, inspector=session, progress=False)
    assert _rows_once(result.table) and result.summary["items"] == len(TEXTS)
    pd.testing.assert_frame_equal(result.table, reference)
