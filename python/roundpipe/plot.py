"""``python -m roundpipe.plot run.json -o run.png``: the command that draws a trace as a Gantt
chart. The charts themselves are :mod:`roundpipe.timeline.plot`; this module is their command
line at the path the docs give."""

from roundpipe.timeline.plot import main, plot_trace

__all__ = ["main", "plot_trace"]

if __name__ == "__main__":
    main()
