"""The trainer's experiment logging, read back with TensorBoard's own event reader: every numeric metrics.jsonl
field (validation loss included) at every logged step, the expert load per MoE layer (named by decoder layer), the
expert-load image on its steps. A tracker whose package is missing: tests/loggers/test_loggers.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_tune.cli.train import compose, to_config
from tests.harness import FAST_TRAINER

pytest.importorskip("tensorboard", reason="logger=tensorboard needs tensorboard (pip install 'moe_tune[tensorboard]')")
pytest.importorskip("matplotlib", reason="the expert-load image needs matplotlib")


def test_tensorboard_holds_the_metrics_rows_the_layer_loads_and_the_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    # tiny_deepseek_v3: decoder layer 0 is dense, so the MoE layers' loads are layer_1 and layer_2 (they were
    # logged as layer_0 and layer_1, counting MoE layers).
    overrides = ["model=tiny_deepseek_v3", "train.steps=4", "train.eval_every=2", "data.val_fraction=0.1"]
    overrides += ["logger=tensorboard"]
    overrides += ["logger.expert_load_image_every=2", f"output_dir={tmp_path}", "checkpoint.export_hf=false"]
    try:
        trainer = Trainer(to_config(compose([*FAST_TRAINER, *overrides])))
        trainer.fit()
    finally:
        destroy_distributed()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()

    keys = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, int | float)}
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl", "expert_load_max_over_mean"} <= keys
    for key in keys:
        logged = [(e.step, np.float32(e.value)) for e in acc.Scalars(key)]
        assert logged == [(r["step"], np.float32(r[key])) for r in rows if key in r], key
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 4]

    tags = sorted(t for t in acc.Tags()["scalars"] if t.startswith("expert_load/"))
    assert tags == ["expert_load/layer_1", "expert_load/layer_2"]
    per_layer = [[e.value for e in acc.Scalars(tag)] for tag in tags]
    mean_over_layers = np.mean(per_layer, axis=0)  # the metrics row's field is their mean
    loaded = [r for r in rows if "expert_load_max_over_mean" in r]  # the rows of the steps where the host waits
    assert [e.step for e in acc.Scalars("expert_load/layer_1")] == [r["step"] for r in loaded] == [2, 4]
    assert mean_over_layers == pytest.approx([r["expert_load_max_over_mean"] for r in loaded], rel=1e-5)
    assert all(v >= 1.0 for layer in per_layer for v in layer)  # max over mean

    assert [(i.step, i.width > 0) for i in acc.Images("expert_load")] == [(2, True), (4, True)]
