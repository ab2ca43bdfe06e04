"""Under bf16 compute (bf16_fp32_master), sigmoid routers still see fp32 weights; softmax routers compute
in the activations' dtype as transformers does."""

import pytest
import torch

from moe_tune.config import Config
from moe_tune.distributed.dims import ParallelDims
from moe_tune.distributed.mesh import build_mesh
from moe_tune.distributed.parallelize import parallelize
from moe_tune.distributed.process_group import destroy_distributed, init_distributed
from moe_tune.models.init import init_random
from moe_tune.models.model import build_model, materialize
from moe_tune.models.presets import preset_config


@pytest.mark.parametrize(
    "preset,router_dtype", [("tiny_deepseek_v3", torch.float32), ("tiny_qwen3_moe", torch.bfloat16)]
)
def test_router_weight_dtype_in_forward(preset, router_dtype, no_launcher):
    init_distributed()
    try:
        model = build_model(preset_config(preset, {"num_hidden_layers": 2}, vocab_size=64))
        cfg = Config()
        cfg.train.precision = "bf16_fp32_master"
        parallelize(model, build_mesh(ParallelDims(1, 1, 1, 1), "cpu"), cfg)
        materialize(model, "cpu")
        init_random(model, num_experts=model.num_experts)
        seen = []
        router = model.moe_layers()[0].router
        router.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        model(torch.randint(0, 64, (1, 8)))
        assert seen == [router_dtype]
    finally:
        destroy_distributed()
