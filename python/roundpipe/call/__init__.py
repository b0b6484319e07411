"""One call of one model: its stages made resident on the devices in turn, its layers run in
forward or recompute, its backward stages, and the activations moved between devices.

``pipeline.py`` sequences a call (``Call``); ``stage.py`` makes stages resident (upload, binding,
gradient download); ``layer_loop.py`` runs a stage's layers; ``saved_inputs.py`` keeps the inputs
the backward stages recompute from; ``backward_stage.py`` runs them; ``transfers.py`` moves
activations; ``checks.py`` checks what flows through; ``autograd.py`` connects a ``forward()`` to
autograd; ``lock.py`` makes a model's calls take turns.
"""
