"""The module path roundpipe 0.1.1 kept its model wrapping in: ``wrap_model_to_roundpipe`` and
the classes it returns (the implementation lives in :mod:`roundpipe.models`)."""

from roundpipe.models import AutoRoundPipe, wrap_model_to_roundpipe
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig

__all__ = ["AutoRoundPipe", "RoundPipe", "RoundPipeRunConfig", "wrap_model_to_roundpipe"]
