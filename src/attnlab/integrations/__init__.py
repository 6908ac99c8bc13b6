"""Bridges from other libraries to attnlab's attention.

* :mod:`attnlab.integrations.transformers` -- ``register()`` makes ``attn_implementation="attnlab"``
  available in Hugging Face transformers models.

The modules here import their third-party library only when called, so importing attnlab never
needs them.

Example:
    >>> from attnlab.integrations import transformers as hf_bridge
    >>> hf_bridge.DEFAULT_NAME
    'attnlab'
"""
