"""The analysis as a readable terminal report (rich): model card, findings per analysis, a layer × head grid."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agent_tools.report.job import AnalysisResult
from agent_tools.report.outputs import SECTION_TITLES, role_grid_values

SHADES = " ░▒▓█"
# One mark per primary role (keys are outputs.ROLE_ABBREVIATIONS values).
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


def _card(result: AnalysisResult) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    description = result.reports.get("describe_model")
    if description is not None:
        for key in ("family", "num_layers", "num_heads", "num_kv_heads", "head_dim", "scaling", "positional", "mask"):
            table.add_row(Text(key, style="dim"), str(getattr(description, key)))
    table.add_row(Text("tokens", style="dim"), str(len(result.tokens)))
    return table


def _section(name: str, result: AnalysisResult) -> Panel:
    report = result.reports[name]
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
    content = Group(Text(report.summary), body) if report.findings else Text(report.summary)
    return Panel(content, title=SECTION_TITLES.get(name, name), title_align="left")


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


def print_report(result: AnalysisResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(Panel(_card(result), title=f"Attention of {result.model}", title_align="left"))
    for name in result.reports:
        if name != "describe_model":
            console.print(_section(name, result))
    console.print(_grid(result))
    for name, why in result.skipped.items():
        console.print(Text(f"skipped {name}: {why}", style="dim"))
    timing = ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
    console.print(Text(f"timings: {timing}", style="dim"))
