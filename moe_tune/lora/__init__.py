"""LoRA: low-rank adapters on attention, dense and shared MLPs and the routed experts, the base frozen.

``LoRASpec`` is the run's choice (``peft=lora``); ``linear`` adapts single linears (through a forward hook, so
the base module and its parameter names stay as they are: a plain ``nn.Linear`` or TransformerEngine's),
``experts`` adapts the stacked experts with per-expert A and B stacked like the base weights and run through the
same grouped GEMMs. Adapter parameters are the only ones named ``*.lora.*`` (``ADAPTER``).
"""

from moe_tune.lora.experts import ExpertsAdapter
from moe_tune.lora.linear import LinearAdapter, apply_linear_adapters
from moe_tune.lora.spec import ADAPTER, LINEAR_GROUPS, TARGET_GROUPS, LoRASpec, frozen_base_dtype, is_adapter

__all__ = [
    "ADAPTER",
    "LINEAR_GROUPS",
    "TARGET_GROUPS",
    "ExpertsAdapter",
    "LinearAdapter",
    "LoRASpec",
    "apply_linear_adapters",
    "frozen_base_dtype",
    "is_adapter",
]
