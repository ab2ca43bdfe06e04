"""A model that cannot fit the host's memory on a CPU-only machine is refused before it is materialized: the floor
counted against the model as built and trained, the memory read from the kernel and the cgroup, and the CLI's one
line with nothing written."""

from __future__ import annotations

import re

import pytest
import torch

from moe_tune.build import assemble, model_options
from moe_tune.config import ConfigError
from moe_tune.config.overrides import check, to_config
from moe_tune.distributed.dims import ParallelDims
from moe_tune.models import host_memory
from tests.harness import run_main
from tests.tiny import tiny_config


def _built(*overrides: str):
    cfg = to_config(check(list(overrides)))
    hf = tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64)  # NF4's blocks of 32 inputs
    return assemble(hf, model_options(cfg, ParallelDims(1, 1, 1, 1)), lambda m: None, "cpu")


@pytest.mark.parametrize("overrides", [(), ("peft=lora",), ("peft=lora", "peft.quantize_base=nf4")])
def test_the_floor_is_what_one_adamw_step_holds(overrides):
    """Weights: every parameter and buffer as materialized. States: each trained parameter's gradient and AdamW's
    two moments after a real step (LoRA: the adapters' only; the frozen base has none)."""
    model = _built(*overrides)
    weights, states = host_memory.needed_bytes(model, training=True)
    assert weights == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained)
    model(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8))).loss.backward()
    opt.step()
    held = [p.grad for p in trained] + [s for st in opt.state.values() for s in st.values() if s.dim() > 0]
    assert states == sum(t.numel() * t.element_size() for t in held)
    assert host_memory.needed_bytes(model, training=False) == (weights, 0)
    if overrides:  # the frozen base is counted once, as weights
        assert states < 3 * weights


def test_available_memory_is_capped_by_the_cgroup_and_shared_by_the_nodes_ranks(tmp_path, monkeypatch):
    free = host_memory.available_bytes()
    assert free is not None and free > 0  # Linux: /proc/meminfo
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{2**30}\n")
    usage.write_text(f"{2**28}\n")
    monkeypatch.setattr(host_memory, "_CGROUP_FILES", ((str(limit), str(usage)),))
    assert host_memory.available_bytes() == min(free, 2**30 - 2**28)
    limit.write_text("max\n")  # no limit: the kernel's figure stands
    assert abs(host_memory.available_bytes() - free) < 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_memory.local_ranks() == 4


def test_a_model_over_the_hosts_share_is_refused_with_its_sizes():
    model = _built()
    weights, states = host_memory.needed_bytes(model, training=True)
    host_memory.check_fits_host(model, training=True)  # the tiny model fits this machine
    for available, refused in ((weights + states, False), (weights + states - 1, True)):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(host_memory, "available_bytes", lambda a=available: a)
            if not refused:
                host_memory.check_fits_host(model, training=True)
                continue
            with pytest.raises(ConfigError, match="no GPU is visible.*num_hidden_layers"):
                host_memory.check_fits_host(model, training=True)


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "deepseek_v3", "tiny_qwen3_moe"])
def test_the_smaller_model_the_line_names_composes_for_every_preset(model):
    """The line's example override is taken as given, whether the preset sets num_hidden_layers or not."""
    built = _built()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(host_memory, "available_bytes", lambda: 1)
        with pytest.raises(ConfigError) as e:
            host_memory.check_fits_host(built, training=True)
    fix = re.search(r"e\.g\. (\S+)", str(e.value))[1]
    assert to_config(check([f"model={model}", fix])).model.overrides["num_hidden_layers"] == 2


def test_the_cli_refuses_it_in_one_line_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**20)
    out = tmp_path / "run"
    r = run_main([f"output_dir={out}", "train.steps=1"])
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "GiB of host memory on the CPU" in lines[0] and "0.0 GiB available" in lines[0]
    assert not out.exists()


def test_the_kernels_figure_is_memavailable_in_bytes(monkeypatch):
    """/proc/meminfo gives kB; MemAvailable (what can be given without swapping), not MemFree (which leaves out the
    page cache) nor MemTotal. No cgroup limit here."""
    import io

    meminfo = "MemTotal:        8000 kB\nMemFree:         1000 kB\nMemAvailable:    3000 kB\nCached:    2000 kB\n"
    real_open = open
    monkeypatch.setattr(host_memory, "_CGROUP_FILES", ())
    monkeypatch.setattr(
        host_memory,
        "open",
        lambda p, *a: io.StringIO(meminfo) if p == "/proc/meminfo" else real_open(p, *a),
        raising=False,
    )
    assert host_memory.available_bytes() == 3000 * 1024


def test_each_rank_on_the_node_gets_its_share(monkeypatch):
    """The node's ranks materialize at once: each is held to the memory available divided by their number."""
    model = _built()
    need = sum(host_memory.needed_bytes(model, training=True))
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2 * need)
    for ranks, refused in (("1", False), ("2", False), ("3", True)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        if not refused:
            host_memory.check_fits_host(model, training=True)
            continue
        with pytest.raises(ConfigError, match=f"this process has {2 * need / 3 / host_memory.GIB:.1f} GiB available"):
            host_memory.check_fits_host(model, training=True)


def test_assemble_counts_the_training_states_only_for_training(monkeypatch):
    """``assemble(training=True)`` holds the model to its weights with their gradients and AdamW moments; without
    ``training``, to its weights alone."""
    weights, states = host_memory.needed_bytes(_built(), training=True)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: weights + states - 1)
    cfg = to_config(check([]))
    hf = tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64)
    options = model_options(cfg, ParallelDims(1, 1, 1, 1))
    assemble(hf, options, lambda m: None, "cpu")
    with pytest.raises(ConfigError, match="GiB of gradients and AdamW moments"):
        assemble(hf, options, lambda m: None, "cpu", training=True)
