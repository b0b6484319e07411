"""Checkpoints: ``save_checkpoint``/``load_checkpoint`` (``checkpoint.py``: atomic, checksummed
files of a model's, optimizer's and scaler's state), a RoundPipe's own state-dict entries
(``model_state.py``), and the sharded checkpoints of data-parallel models (``sharded.py`` maps the
state to named pieces, ``sharded_files.py`` writes and reads the folder)."""
