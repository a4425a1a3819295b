"""``attention-explainer corpus TASK DATA``: one task over every item of a data file, locally or on Ray.

    attention-explainer corpus profile chats.jsonl --out runs/chats            # per-head roles over the corpus
    attention-explainer corpus trace chats.jsonl --max-errors 10               # which segment the answers read
    attention-explainer corpus collapse texts.parquet --engine ray --actors 4 --actor-gpus 0.5
    attention-explainer corpus profile ./my_dataset --engine ray --ray-address ray://head:10001

Writes OUT/table.parquet, errors.parquet, summary.json and report.html (see :mod:`agent_tools.runs.store`);
run the same command again after a kill to continue.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector

# agent_tools.corpus.tasks.TASKS without importing torch for --help (tests/test_corpus.py holds them equal); an
# unknown task is refused there in one line, exit 2
TASK_NAMES = ("profile", "trace", "collapse", "kv_cache", "retrieval", "position")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "corpus",
        help="run a task (profile, trace, collapse, kv_cache, retrieval, position) over a corpus; local or Ray",
        description="Run one task over every item of DATA and write a Parquet table, errors, a summary with "
        "bootstrap intervals and an HTML page. Rerun the same command to continue a stopped run.",
    )
    p.add_argument("task", metavar="TASK", help=f"one of {', '.join(TASK_NAMES)}")
    p.add_argument("data", metavar="DATA", help="a .jsonl or .parquet file, or a datasets folder (save_to_disk)")
    p.add_argument("--out", default=None, help="output folder (default: ./corpus-TASK-DATASTEM)")
    p.add_argument("--model", default=None, help="model reference (default: the session's default model)")
    p.add_argument("--engine", choices=("local", "ray"), default="local", help="default: %(default)s")
    p.add_argument("--actors", type=int, default=2, help="Ray: actors in the pool, one model each (default: 2)")
    p.add_argument("--actor-gpus", type=float, default=0.0, help="Ray: GPUs per actor, e.g. 0.25 (default: 0)")
    p.add_argument("--actor-cpus", type=int, default=1, help="Ray: CPU threads per actor (default: 1)")
    p.add_argument("--ray-address", default=None, help="Ray: join this cluster (default: start a local Ray)")
    p.add_argument(
        "--max-restarts", type=int, default=3, help="Ray: actor deaths the run survives, then it stops (default: 3)"
    )
    p.add_argument(
        "--max-task-retries",
        type=int,
        default=2,
        help="Ray: times one batch is retried after its actor died (default: 2)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="items per batch and per checkpoint (default: 8)")
    p.add_argument("--max-errors", type=int, default=None, help="stop after more than N bad rows (default: never)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default: 1000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown only on a terminal)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.corpus.api import run_corpus
    from agent_tools.corpus.ray_engine import RayOptions
    from agent_tools.loading import caller_shows_progress

    pool = RayOptions(
        actors=args.actors,
        actor_gpus=args.actor_gpus,
        actor_cpus=args.actor_cpus,
        address=args.ray_address,
        max_restarts=args.max_restarts,
        max_task_retries=args.max_task_retries,
    )
    with caller_shows_progress():  # the run's own bar is on the terminal: a model load inside it draws none
        result = run_corpus(
            args.task,
            args.data,
            out=args.out,
            engine=args.engine,
            inspector=inspector,
            model=args.model,
            batch_size=args.batch_size,
            max_errors=args.max_errors,
            ray_options=pool,
            resamples=args.bootstrap,
            seed=args.seed,
            progress=False if args.no_progress else None,
        )
    print(_headline(result.summary, str(result.out), result.arrow.num_rows))
    return 0


def _headline(summary: dict[str, Any], out: str, rows: int) -> str:
    """What the run found, in three lines: counts and files, then the stable/variable heads or the leaders."""
    per = "segment" if summary["task"] == "trace" else "head"
    lines = [
        f"corpus {summary['task']} on {summary['model']}: {summary['items']} items, {summary['analysed']} analysed, "
        f"{summary['errors']} errors -> {out}",
        f"  table.parquet ({rows} rows, item x {per}), errors.parquet, summary.json, report.html",
    ]
    if summary["task"] == "trace":
        leaders = ", ".join(f"{name} {count}" for name, count in list(summary["read_most"].items())[:4])
        lines.append(f"  read most: {leaders or 'none'}")
    else:
        stable = ", ".join(f"{h['head']} {h['role']}" for h in summary["stable_heads"][:4])
        lines.append(
            f"  stable heads: {len(summary['stable_heads'])}{' (' + stable + ', ...)' if stable else ''}; "
            f"variable heads: {len(summary['variable_heads'])}"
        )
    return "\n".join(lines)
