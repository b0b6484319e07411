"""The optimizer's parts: the host optimizer ``roundpipe.optim.Adam`` (``adam.py``, roundpipe
0.1.1's module path; its moments' forms in ``adam_state.py``), the optimizer copies
(``copies.py``) and their files on disk with ``optim_offload`` (``offload.py``), each model's
step pipeline (``step.py``) on the process's optimizer thread (``step_thread.py``), and
``GradScaler`` (``grad_scaler.py``)."""

from roundpipe.optim.adam import Adam, fused_writeback, get_num_threads, set_num_threads

__all__ = ["Adam", "fused_writeback", "get_num_threads", "set_num_threads"]
