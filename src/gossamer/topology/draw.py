"""Drawing a topology to a PNG file."""

from __future__ import annotations

import os
from pathlib import Path

from gossamer.topology.topology import Topology

__all__ = ["draw"]

_LAYOUTS = ("circular", "spring", "shell")


def draw(
    topology: Topology,
    path: str | os.PathLike[str],
    *,
    layout: str = "circular",
    title: str | None = None,
) -> Path:
    """Draw ``topology`` as a directed graph and save it as a PNG.

    Nodes are labelled by rank, each edge ``i -> j`` is an arrow whose width grows with
    ``W[i, j]``, and self-loops are left out. Rendering uses matplotlib's Agg canvas
    directly, so pyplot's global backend and figure list are untouched.

    Args:
        topology: The topology to draw.
        path: Where to write the PNG; its folder must exist.
        layout: Node placement: ``"circular"``, ``"spring"`` (seeded) or ``"shell"``.
        title: Figure title; defaults to ``topology.name``, or its ``repr`` when unnamed.

    Returns:
        ``path`` as a ``pathlib.Path``.

    Raises:
        TypeError: ``topology`` is not a ``Topology``, ``path`` is not a path, or ``title``
            is not a string.
        ValueError: ``layout`` is not one of the three names.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(_LAYOUTS)}; got {layout!r}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None; got {type(title).__name__}")

    # Imported here: networkx and matplotlib take a second of every rank's start-up.
    import networkx as nx
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    graph = topology.to_networkx()
    graph.remove_edges_from(list(nx.selfloop_edges(graph)))
    widths = [0.5 + 3.0 * data["weight"] for _, _, data in graph.edges(data=True)]
    figure = Figure(figsize=(6, 6))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    nx.draw_networkx(
        graph,
        # A fixed seed keeps repeated drawings of one topology identical.
        pos=nx.spring_layout(graph, seed=0)
        if layout == "spring"
        else getattr(nx, f"{layout}_layout")(graph),
        ax=axes,
        node_color="#9ecae1",
        width=widths,
        arrows=True,
        arrowstyle="-|>",
        # Curved edges keep the two directions of a link apart.
        connectionstyle="arc3,rad=0.1",
    )
    axes.set_title(title if title is not None else topology.name or repr(topology))
    axes.set_axis_off()
    out = Path(path)
    figure.savefig(out, format="png")
    return out
