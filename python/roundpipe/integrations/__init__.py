"""Integrations of RoundPipe with training frameworks.

``roundpipe.integrations.transformers.RoundPipeTrainer`` trains through Hugging Face's
``transformers.Trainer`` (``pip install 'roundpipe[transformers]'``). Nothing here is imported by
``import roundpipe``.
"""
