"""Packed data: the per-microbatch values of one output leaf with the events of their transfers,
what a RoundPipe returns with ``merge_output=False`` and what a downstream RoundPipe consumes
element by element without waiting on the host (how models are chained).
``roundpipe.batch.RoundPipePackedData`` is its 0.1.1 path."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class Event(Protocol):
    """Anything a consumer can wait on: a ``torch.cuda.Event`` or a runtime transfer event."""

    def synchronize(self) -> None: ...


class RoundPipePackedData(list[Any]):
    """Per-microbatch values of one output leaf, returned when ``merge_output=False``.

    A plain ``list`` of the microbatch values (element ``m`` belongs to microbatch ``m``) plus
    ``transfer_event``: for each element a ``(forward_event, backward_event)`` pair, as roundpipe
    0.1.1 keeps them. The forward event completes the value's transfer (``None``: ready); the
    backward event is kept for code that reads it (this runtime hands gradients back through
    autograd and needs none). ``RoundPipePackedData(data, transfer_event)`` takes such pairs, or
    one forward event (or ``None``) per value; ``events`` lists the forward events.

    Passing packed data to another RoundPipe with the same ``num_microbatch`` hands element ``m``
    to microbatch ``m`` without waiting on the host; call :meth:`synchronize` before reading the
    values yourself.
    """

    def __init__(self, data: Iterable[Any] = (), transfer_event: Sequence[Any] | None = None):
        super().__init__(data)
        if transfer_event is None:
            transfer_event = [None] * len(self)
        if isinstance(transfer_event, (str, bytes)) or not isinstance(transfer_event, Sequence):
            raise TypeError(
                "RoundPipePackedData's transfer_event must be a list with one "
                f"(forward_event, backward_event) pair or event per value, got "
                f"{type(transfer_event).__name__}"
            )
        if len(transfer_event) != len(self):
            raise ValueError(
                f"RoundPipePackedData got {len(self)} values but {len(transfer_event)} events; "
                "pass one (forward_event, backward_event) pair, event or None per value"
            )
        self.transfer_event: list[tuple[Event | None, Event | None]] = [
            _event_pair(entry) for entry in transfer_event
        ]

    @property
    def events(self) -> list[Event | None]:
        """The forward event of each value (``None``: ready)."""
        return [forward for forward, _ in self.transfer_event]

    def synchronize(self) -> RoundPipePackedData:
        """Wait until every value has arrived, then return ``self``."""
        for forward, _ in self.transfer_event:
            if forward is not None:
                forward.synchronize()
        self.transfer_event = [(None, backward) for _, backward in self.transfer_event]
        return self

    def __repr__(self) -> str:
        pending = sum(event is not None for event in self.events)
        return f"RoundPipePackedData({list.__repr__(self)}, pending_events={pending})"


def _event_pair(entry: Any) -> tuple[Event | None, Event | None]:
    """A ``transfer_event`` entry as its ``(forward, backward)`` pair."""
    if isinstance(entry, tuple):
        if len(entry) != 2:
            raise ValueError(
                "RoundPipePackedData's transfer_event pairs are (forward_event, backward_event), "
                f"got a tuple of {len(entry)}"
            )
        return entry[0], entry[1]
    return entry, None


__all__ = ["Event", "RoundPipePackedData"]
