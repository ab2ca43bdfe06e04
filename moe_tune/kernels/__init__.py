"""Kernel sets by name: which kernels run the dense parts of each layer, the experts and the loss.

``torch`` (default): SDPA attention, grouped_mm experts, chunked linear cross-entropy (``loss.py``).
``te``: TransformerEngine norms/attention/linears (``te.py``, the only importer of transformer_engine).
The model takes its kernel choices at construction (``moe_tune.models.model.ModelOptions``); this package holds
the kernels and knows nothing of the model.
"""
