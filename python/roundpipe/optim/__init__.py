"""The host optimizer: ``roundpipe.optim.Adam`` (``roundpipe.optim.adam.Adam``, roundpipe
0.1.1's module path), its thread count, and the fused write-back the step pipeline uses."""

from roundpipe.optim.adam import Adam, fused_writeback, get_num_threads, set_num_threads

__all__ = ["Adam", "fused_writeback", "get_num_threads", "set_num_threads"]
