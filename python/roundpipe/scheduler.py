"""Execution plans: which layers form each forward and backward stage."""

from __future__ import annotations


class ModelExecutePlan:
    """The stage partition of one model: ``fwd_plan`` and ``bwd_plan`` are lists of layer ranges.

    Forward stages ascend from layer 0; backward stages descend. For ``forward_backward`` ("fused")
    the first backward stage holds the last layers, which run forward + loss + backward without
    recompute and therefore do not appear in ``fwd_plan``.
    """

    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []

    def __repr__(self) -> str:
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan}, bwd_plan={self.bwd_plan})"
