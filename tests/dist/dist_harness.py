"""Run a test body on N local gloo ranks (torch.multiprocessing spawn), and tiny random checkpoints.

Bodies are module-level functions ``fn(rank, *args)``: spawn pickles them by reference. A failure on any
rank is re-raised in pytest with that rank's traceback.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from moe_tune.dist.env import destroy_distributed, init_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    init_distributed("gloo")
    try:
        fn(rank, *args)
    finally:
        destroy_distributed()


def run_ranks(fn, world_size: int = 2, *args) -> None:
    mp.spawn(_entry, args=(fn, world_size, _free_port(), args), nprocs=world_size, join=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (the absolute error when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


def tiny_qwen3_moe(out_dir: str, num_experts: int = 8, seed: int = 0) -> str:
    """A 2-layer qwen3_moe (hidden 32, top-2) with every weight random, the routers included (Hugging Face
    initialises them to zero, which would send every token to the same experts)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if name.endswith("gate.weight") else 0.2
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + std * torch.randn(p.shape, generator=g))
    model.save_pretrained(out_dir)
    return out_dir
