"""find_circuit's pictures: the circuit as a small layered graph, drawn once from the report's nodes and edges.

Columns are layers (the embeddings left, the logits right), nodes are stacked in their column, an edge is an arrow
from sender to receiver coloured by the input it is read through (Q, K, V, or directly by the logits), its width
the edge's |score|, dashed when it pushes against the clean answer. The same layout gives a PNG (matplotlib) and a
standalone HTML page with the graph as inline SVG (no script: hovering an edge or node shows its sentence) and the
edge table.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from agent_tools.render import png_bytes
from agent_tools.tools.find_circuit.models import CircuitEdge, CircuitNode

COLOURS = {"Q": "#3b5bdb", "K": "#e8590c", "V": "#2b8a3e", "direct": "#495057"}
NAMES = {"Q": "queries (Q)", "K": "keys (K)", "V": "values (V)", "direct": "logits (direct)"}
WIDTH, ROW, MARGIN = 130, 56, 60  # SVG pixels per column, per row, around


@dataclass(frozen=True)
class Layout:
    where: dict[str, tuple[float, float]]  # node name -> (column, row)
    columns: int
    rows: int


def layout(nodes: list[CircuitNode]) -> Layout:
    """Column per layer among the nodes (embeddings first, logits last), rows in order of appearance."""
    layers = sorted({n.layer for n in nodes if n.layer is not None})
    column = {layer: i + 1 for i, layer in enumerate(layers)}
    stacked: dict[int, list[str]] = {}
    for node in nodes:
        at = 0 if node.kind == "embeddings" else len(layers) + 1 if node.kind == "logits" else column[node.layer or 0]
        stacked.setdefault(at, []).append(node.name)
    rows = max((len(names) for names in stacked.values()), default=1)
    where = {}
    for at, names in stacked.items():
        offset = (rows - len(names)) / 2
        for i, name in enumerate(names):
            where[name] = (float(at), offset + i)
    return Layout(where=where, columns=len(layers) + 2, rows=rows)


def _width(score: float, largest: float) -> float:
    return 1.0 + 5.0 * min(1.0, abs(score) / largest) if largest > 0 else 1.0


def circuit_png(nodes: list[CircuitNode], edges: list[CircuitEdge], title: str) -> bytes:
    """The graph as PNG bytes."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    placed = layout(nodes)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * placed.columns, 1.4 + 0.8 * placed.rows))
    largest = max((abs(e.score) for e in edges), default=0.0)
    for edge in edges:
        (x0, y0), (x1, y1) = placed.where[edge.sender], placed.where[edge.receiver]
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops={
                "arrowstyle": "-|>",
                "color": COLOURS[edge.kind],
                "lw": _width(edge.score, largest),
                "ls": "-" if edge.score >= 0 else "--",
                "alpha": 1.0 if edge.in_circuit else 0.45,
                "shrinkA": 14,
                "shrinkB": 14,
                "connectionstyle": "arc3,rad=0.08",
            },
        )
    for name, (x, y) in placed.where.items():
        ax.text(x, y, name, ha="center", va="center", fontsize=8, bbox={"boxstyle": "round", "fc": "white"})
    ax.set_xlim(-0.6, placed.columns - 0.4)
    ax.set_ylim(placed.rows - 0.4, -0.6)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    handles = [Line2D([0], [0], color=COLOURS[k], lw=2, label=f"read through {NAMES[k]}") for k in COLOURS]
    handles.append(Line2D([0], [0], color="#868e96", lw=2, ls="--", label="against the clean answer"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=7, frameon=False)
    return png_bytes(fig)


def circuit_html(nodes: list[CircuitNode], edges: list[CircuitEdge], title: str, summary: str) -> str:
    """A standalone page: the graph as inline SVG (hover for each edge's sentence) and the edge table."""
    placed = layout(nodes)
    largest = max((abs(e.score) for e in edges), default=0.0)

    def point(name: str) -> tuple[float, float]:
        column, row = placed.where[name]
        return MARGIN + column * WIDTH, MARGIN + row * ROW

    width, height = 2 * MARGIN + (placed.columns - 1) * WIDTH, 2 * MARGIN + (placed.rows - 1) * ROW
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" role="img" '
        f'aria-label="{html.escape(title)}">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="context-stroke"/></marker></defs>',
    ]
    for edge in edges:
        (x0, y0), (x1, y1) = point(edge.sender), point(edge.receiver)
        dash = "" if edge.score >= 0 else ' stroke-dasharray="6 4"'
        opacity = 1.0 if edge.in_circuit else 0.45
        stroke = f'stroke="{COLOURS[edge.kind]}" stroke-width="{_width(edge.score, largest):.1f}"'
        parts.append(
            f'<g class="edge"><title>{html.escape(edge.sentence)}</title><line x1="{x0 + 28:.1f}" y1="{y0:.1f}" '
            f'x2="{x1 - 30:.1f}" y2="{y1:.1f}" {stroke} '
            f'stroke-opacity="{opacity}"{dash} marker-end="url(#arrow)"/></g>'
        )
    for node in nodes:
        x, y = point(node.name)
        heads = f" (query heads {', '.join(map(str, node.heads))})" if node.kind == "kv_head" else ""
        parts.append(
            f'<g class="node"><title>{html.escape(node.name + heads)}</title><rect x="{x - 28:.1f}" y="{y - 12:.1f}" '
            f'width="56" height="24" rx="8" fill="#fff" stroke="#343a40"/><text x="{x:.1f}" y="{y + 4:.1f}" '
            f'text-anchor="middle" font-size="11" font-family="sans-serif">{html.escape(node.name)}</text></g>'
        )
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="color:{COLOURS[k]}">&#9473; read through {html.escape(NAMES[k])}</span>' for k in COLOURS
    )
    rows = "\n".join(
        f"<tr><td>{html.escape(e.sender)}</td><td>{html.escape(e.receiver)}</td><td>{e.kind}</td>"
        f"<td>{e.score:.3f}</td><td>{'yes' if e.in_circuit else 'no'}</td><td>{html.escape(e.sentence)}</td></tr>"
        for e in edges
    )
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>'
        + html.escape(title)
        + "</title><style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 6px}"
        ".edge:hover line{stroke-opacity:1;filter:drop-shadow(0 0 2px #000)}"
        "</style></head><body>"
        + f"<h2>{html.escape(title)}</h2><p>{html.escape(summary)}</p>"
        + "".join(parts)
        + f"<p>{legend}; dashed: against the clean answer; faint: listed for |score| only. Hover an edge for its "
        "sentence.</p><table><tr><th>sender</th><th>receiver</th><th>read through</th><th>score (share of the gap)"
        f"</th><th>in circuit</th><th>sentence</th></tr>{rows}</table></body></html>"
    )
