"""Gantt charts of RoundPipe traces: ``python -m roundpipe.plot run.json -o run.png``.

One row per device lane and host thread, one colour per phase, and beside the chart the summary of
:meth:`~roundpipe.timeline.events.Trace.summary` (per-device busy and bubble shares, upload time
hidden behind compute, optimizer time hidden behind the next iteration). ``--predicted pred.json``
(a trace from ``ModelExecutePlan.simulate``) draws the prediction above the measurement on a shared
time axis. Needs matplotlib: ``pip install 'roundpipe[plot]'``.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Sequence
from typing import Any

from roundpipe.timeline.tracing import DEVICE_LANES, HOST_LANES, PHASES, Trace

#: Colour of each phase (matplotlib's colour-blind friendly tab10/tab20 entries).
PHASE_COLORS: dict[str, str] = {
    "forward": "#1f77b4",
    "recompute": "#aec7e8",
    "backward": "#ff7f0e",
    "fused": "#9467bd",
    "upload": "#2ca02c",
    "grad_download": "#d62728",
    "grad_reduce": "#ff9896",
    "activation": "#17becf",
    "optimizer_step": "#8c564b",
    "writeback": "#e377c2",
    "wait": "#c7c7c7",
    "disk_read": "#bcbd22",
    "disk_write": "#dbdb8d",
}

_ROW_INCHES = 0.32


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "roundpipe.plot needs matplotlib; install it with: pip install 'roundpipe[plot]' "
            "(or pip install matplotlib)"
        ) from error
    return Figure, FigureCanvasAgg


def _as_trace(value: Trace | str | os.PathLike[str], name: str) -> Trace:
    if isinstance(value, Trace):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Trace.load(value)
    raise TypeError(f"{name} must be a Trace or a path to a trace JSON, got {type(value).__name__}")


def _rows(trace: Trace) -> list[tuple[int | None, str]]:
    """(device, lane) of every row: devices in order, then the host; each one's lanes in display
    order, then lanes of other names (a loaded trace's unnamed threads) by name."""

    def order(row: tuple[int | None, str]) -> tuple[bool, int, int, str]:
        device, lane = row
        lanes = HOST_LANES if device is None else DEVICE_LANES
        position = lanes.index(lane) if lane in lanes else len(lanes)
        return (device is None, device or 0, position, lane)

    return sorted({(e.device, e.lane) for e in trace.events}, key=order)


def _draw(axes: Any, trace: Trace, title: str) -> None:
    rows = _rows(trace)
    for row, (device, lane) in enumerate(rows):
        for phase in PHASES:
            bars = [
                (e.start_us / 1e3, e.dur_us / 1e3)
                for e in trace.events
                if e.device == device and e.lane == lane and e.phase == phase
            ]
            if bars:
                axes.broken_barh(
                    bars,
                    (row - 0.4, 0.8),
                    facecolors=PHASE_COLORS[phase],
                    edgecolors="white",  # separates consecutive microbatches
                    linewidth=0.3,
                )
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(
        [f"host {lane}" if d is None else f"dev {d} {lane}" for d, lane in rows], fontsize=8
    )
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_title(title, fontsize=10, loc="left")
    axes.grid(axis="x", alpha=0.3)
    lines = trace.summary().lines()
    if trace.cut_short is not None:
        lines += ["cut short:", *textwrap.wrap(trace.cut_short, 40)]
    summary = "\n".join(lines)
    axes.text(
        1.01,
        1.0,
        summary,
        transform=axes.transAxes,
        va="top",
        ha="left",
        fontsize=8,
        family="monospace",
    )


def plot_trace(
    trace: Trace | str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    predicted: Trace | str | os.PathLike[str] | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> None:
    """Draw ``trace`` (and ``predicted`` above it, sharing the time axis) as a Gantt chart.

    Args:
        trace: a :class:`roundpipe.timeline.tracing.Trace` or the path of a trace JSON.
        output: the image file to write; the format follows its suffix (``.png``, ``.svg``, ...).
        predicted: an optional predicted trace (or its path) drawn above the measured one.
        title: the measured chart's title (default: ``"measured"`` or the trace's file name).
        dpi: resolution of raster output.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError: an argument has the wrong type.
        ValueError: a trace has no events.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    charts: list[tuple[Trace, str]] = []
    if predicted is not None:
        charts.append((_as_trace(predicted, "predicted"), "predicted (simulator)"))
    default_title = os.fspath(trace) if isinstance(trace, (str, os.PathLike)) else "measured"
    charts.append((_as_trace(trace, "trace"), title or default_title))
    for chart, label in charts:
        if not chart.events:
            raise ValueError(f"the {label} trace has no events; nothing to plot")
    if isinstance(dpi, bool) or not isinstance(dpi, int) or dpi < 1:
        raise ValueError(f"dpi must be a positive int, got {dpi!r}")

    heights = [max(len(_rows(chart)), 2) for chart, _ in charts]
    figure = Figure(figsize=(11, _ROW_INCHES * sum(heights) + 1.2 * len(charts) + 0.6))
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(len(charts), 1, height_ratios=heights, right=0.72, hspace=0.45)
    first = None
    for index, (chart, label) in enumerate(charts):
        axes = figure.add_subplot(grid[index], sharex=first)
        first = first or axes
        _draw(axes, chart, label)
    axes.set_xlabel("time (ms)")
    phases = [p for p in PHASES if any(e.phase == p for chart, _ in charts for e in chart.events)]
    handles = [_patch(PHASE_COLORS[p]) for p in phases]
    figure.legend(handles, phases, loc="lower right", fontsize=8, ncol=2, frameon=False)
    figure.savefig(os.fspath(output), dpi=dpi, bbox_inches="tight")


def _patch(color: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=color)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``python -m roundpipe.plot run.json [-o run.png] [--predicted pred.json]``."""
    parser = argparse.ArgumentParser(
        prog="python -m roundpipe.plot", description="Gantt chart of a RoundPipe trace."
    )
    parser.add_argument("trace", help="trace JSON written by roundpipe.trace / ROUNDPIPE_TRACE")
    parser.add_argument("-o", "--output", help="image to write (default: the trace's name .png)")
    parser.add_argument("--predicted", help="predicted trace JSON, drawn above the measurement")
    parser.add_argument("--title", help="title of the measured chart")
    parser.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")
    args = parser.parse_args(argv)
    output = args.output or os.path.splitext(args.trace)[0] + ".png"
    try:
        plot_trace(args.trace, output, predicted=args.predicted, title=args.title, dpi=args.dpi)
    except (ImportError, OSError, ValueError) as error:
        # No matplotlib, an unreadable or malformed trace: one line that says which.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(output)
