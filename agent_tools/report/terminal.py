"""The analysis as a readable terminal report (rich): the model card once, the story step by step (its pictures
named by the files they were written to), the findings of each analysis under the question it answers, a layer
× head grid and the glossary of the terms used."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agent_tools.report.content import model_card, role_grid_values, sections
from agent_tools.report.glossary import terms_in
from agent_tools.report.job import AnalysisResult
from agent_tools.report.story import StoryStep, build_story, read_first
from agent_tools.schemas import Report

SHADES = " ░▒▓█"
# One mark per primary role (keys are content.ROLE_ABBREVIATIONS values).
ROLE_MARKS = {
    "prev": "←",
    "next": "→",
    "ind": "I",
    "dup": "D",
    "sink": "S",
    "self": "○",
    "loc": "L",
    "brd": "B",
    "spec": "*",
    "punc": ".",
}


def _card(result: AnalysisResult) -> Group:
    table = Table(show_header=False, box=None, pad_edge=False)
    for key, value in model_card(result):
        table.add_row(Text(key, style="dim"), str(value))
    description = result.reports.get("describe_model")
    parts: list[Text | Table] = [Text(description.summary)] if description is not None else []
    return Group(*parts, table, Text(read_first(result, where="terminal"), style="italic"))


def _story_step(step: StoryStep, out: Path | None) -> Panel:
    """One step: the question, the sentences, and the files its pictures were written to."""
    lines: list[Text] = [Text(step.question, style="italic dim"), Text(" ".join(step.sentences))]
    for picture in step.pictures:
        where = f"{out / (picture.name + '.png')}" if out is not None else f"{picture.name}.png (with --out)"
        lines.append(Text(f"picture: {picture.caption} — {where}", style="dim"))
    return Panel(Group(*lines), title=f"{step.number}. {step.title}", title_align="left", border_style="blue")


def _section(title: str, question: str, report: Report) -> Panel:
    body = Table(show_header=True, header_style="bold", box=None)
    body.add_column("layer", justify="right")
    body.add_column("head", justify="right")
    body.add_column("finding")
    for finding in report.findings[:8]:
        body.add_row(
            "" if finding.layer is None else str(finding.layer),
            "" if finding.head is None else str(finding.head),
            finding.detail,
        )
    parts: list[Text | Table] = []
    if question:
        parts.append(Text(question, style="italic dim"))
    parts.append(Text(report.summary))
    if report.findings:
        parts.append(body)
    return Panel(Group(*parts), title=title, title_align="left")


def _grid(result: AnalysisResult) -> Panel:
    """Layer × head: shade = concentration (1 − normalised entropy); a letter = primary role when profiled."""
    concentration = 1 - result.maps.normalised_entropy
    roles = role_grid_values(result)
    layers, heads = concentration.shape
    lines = [Text("     " + "".join(f"{h:>3}" for h in range(heads)), style="dim")]
    for layer in range(layers):
        line = Text(f"L{layer:<3} ", style="dim")
        for head in range(heads):
            value = float(concentration[layer, head])
            shade = SHADES[min(len(SHADES) - 1, int(value * len(SHADES)))]
            mark = ROLE_MARKS.get(roles[1][layer][head], "·") if roles else shade
            style = "bold red" if value > 0.8 else ("yellow" if value > 0.5 else "green")
            line.append(f"  {mark}" if roles else f" {shade * 2}", style=style)
        lines.append(line)
    legend = "shade/colour: concentration = 1 − normalised entropy (red > 0.8, yellow > 0.5)"
    if roles:
        legend += "; mark: primary role (" + ", ".join(f"{m} {n}" for n, m in ROLE_MARKS.items()) + ", · none)"
    lines.append(Text(legend, style="dim"))
    return Panel(Group(*lines), title="Layer × head grid", title_align="left")


def _glossary(result: AnalysisResult, steps: list[StoryStep]) -> Panel:
    """The glossary lines of the terms this report uses."""
    used = " ".join(" ".join(s.sentences) for s in steps)
    used += " ".join(result.reports[n].summary for n in result.reports)
    table = Table(show_header=False, box=None, pad_edge=False)
    for term in terms_in(used):
        table.add_row(Text(term.name, style="bold"), f"{term.formula} — {term.meaning}")
    return Panel(table, title="Glossary", title_align="left")


def print_report(result: AnalysisResult, console: Console | None = None, *, out: Path | None = None) -> None:
    """The whole report; ``out``: the folder the pictures were written to (default: where ``write_outputs`` put
    them), named next to each step."""
    console = console or Console()
    out = out if out is not None else result.written_to
    console.print(Panel(_card(result), title=f"Attention of {result.model}", title_align="left"))
    steps = build_story(result)
    for step in steps:
        console.print(_story_step(step, out))
    for title, question, report in sections(result):
        console.print(_section(title, question, report))
    console.print(_grid(result))
    console.print(_glossary(result, steps))
    for name, why in result.skipped.items():
        console.print(Text(f"skipped {name}: {why}", style="dim"))
    timing = ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
    console.print(Text(f"timings: {timing}", style="dim"))
