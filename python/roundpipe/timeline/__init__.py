"""The timeline of a run: ``roundpipe.trace`` records every call's schedule as a Chrome trace
(``tracing.py``, written by ``tracer.py`` into ``file.py``'s format, events in ``events.py``), the
planner's prediction as the same kind of trace (``prediction.py``), and Gantt charts of either
(``plot.py``)."""
