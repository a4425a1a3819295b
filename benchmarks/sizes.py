"""What an agent reads, in bytes: tool declarations and every tool's answer to its example (issue 18's budgets).

  declarations  tool descriptions + input schemas as agents get them (the bundled-model allow-list): the
                OpenAI-style ``tools`` list and the MCP ``tools/list`` (with output schemas), compact UTF-8 JSON
  answers       per tool, on the default model with its ``example``: the concise text an LLM reads (LangChain
                content, MCP text, OpenAI tool message), the structured report with ``detail: "summary"`` (the
                default) and with ``detail: "full"``, and the follow-up calls it names

Budgets: text ≤ 2 KB, summary report ≤ 16 KB, descriptions + input schemas ≤ 10 KB, MCP tools/list ≤ 32 KB
(issue 28's targets; tests/test_budgets.py holds what is met today). Long inputs (8,192 tokens) are held to the
same text and report budgets by tests/test_budgets.py (``-m slow``); start-up and error times are in
benchmarks/mcp_startup.py and benchmarks/early_errors.py.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/sizes.py            # a Markdown table on stdout
    OMP_WAIT_POLICY=PASSIVE python benchmarks/sizes.py --no-run   # declarations only (no model)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agent_tools.inspector import Inspector
from agent_tools.loading import ModelPolicy
from agent_tools.surfaces import concise_text
from agent_tools.surfaces.openai import openai_tools
from agent_tools.tools import TOOLS

TEXT_BUDGET = 2 * 1024
REPORT_BUDGET = 16 * 1024
DECLARATIONS_BUDGET = 10 * 1024
TOOLS_LIST_BUDGET = 32 * 1024


def size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON (how the SDKs send it), or of a string as it is."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode())


def declaration_sizes() -> dict[str, int]:
    """Per tool: description + input schema as the OpenAI-style list declares it (``total`` = all tools)."""
    sizes = {t["function"]["name"]: size(t["function"]["description"]) + size(t["function"]["parameters"])
             for t in openai_tools()}  # fmt: skip
    return {**sizes, "total": sum(sizes.values())}


def mcp_tools_list() -> dict[str, Any] | str:
    """The MCP server's ``tools/list`` result, or why it could not be built (the MCP extra is optional)."""
    try:
        from agent_tools.mcp_front import tool_listing
    except ImportError as exc:
        return f"MCP surface not importable: {exc}"
    return tool_listing(TOOLS, ModelPolicy.bundled_only())


def answer_sizes(inspector: Inspector) -> list[dict[str, Any]]:
    """Every tool's example on the default model: text, summary and full report sizes, and the next calls."""
    rows = []
    for name, spec in TOOLS.items():
        full = spec(inspector, {**spec.example, "detail": "full"})
        summary = spec.check(full.model_copy(deep=True), inspector, arguments=spec.parse(spec.example))
        calls = summary.model_dump(mode="json")["next_calls"]
        rows.append(
            {
                "tool": name,
                "text": size(concise_text(summary)),
                "summary": size(summary.model_dump(mode="json")),
                "full": size(full.model_dump(mode="json")),
                "cut": ", ".join(f"{o.field} {o.kept}/{o.total}" for o in summary.omitted) or "—",
                "next": ", ".join(c.tool for c in summary.next_calls) or "—",
                "next bytes": size(calls),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-run", action="store_true", help="declarations only: load no model")
    args = parser.parse_args(argv)
    declared = declaration_sizes()
    listed = mcp_tools_list()
    openai_list = size(openai_tools())
    print("| what | bytes | budget |\n|---|---:|---:|")
    tools = len(declared) - 1  # "total" is not a tool
    print(f"| descriptions + input schemas ({tools} tools) | {declared['total']:,} | {DECLARATIONS_BUDGET:,} |")
    print(f"| OpenAI-style `tools` list | {openai_list:,} | |")
    if isinstance(listed, str):
        print(f"| MCP `tools/list` | {listed} | {TOOLS_LIST_BUDGET:,} |")
    else:
        schemas = sum(size(t.get("outputSchema", {})) for t in listed["tools"])
        print(f"| MCP `tools/list` with output schemas | {size(listed):,} | {TOOLS_LIST_BUDGET:,} |")
        print(f"| of which output schemas | {schemas:,} | |")
    if args.no_run:
        return 0
    rows = answer_sizes(Inspector())
    print("\n| tool | text | report (summary) | report (full) | lists cut (kept/total) | next calls (bytes) |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        row = f"| {r['tool']} | {r['text']:,} | {r['summary']:,} | {r['full']:,} | {r['cut']} |"
        print(f"{row} {r['next']} ({r['next bytes']:,}) |")
    over = [r["tool"] for r in rows if r["text"] > TEXT_BUDGET or r["summary"] > REPORT_BUDGET]
    print(
        f"\nbudgets: text ≤ {TEXT_BUDGET:,} B, summary report ≤ {REPORT_BUDGET:,} B; over: {', '.join(over) or 'none'}"
    )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
