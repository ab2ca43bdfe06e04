"""``moe-tune`` / ``python -m moe_tune``: the only place a DictConfig exists.

Overrides are composed once up front so that a bad key or value is reported as one line with exit code 2
(Hydra's own handler would print a multi-line error and exit 1); then Hydra runs the job as usual, which
keeps multirun and launchers (``hydra/launcher=submitit_slurm ... -m``) working.
"""

from __future__ import annotations

import os
import re
import sys

# The configs ship inside the package, so an installed wheel finds them wherever it runs.
CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


# OmegaConf's conversion error: "Value 'abc' of type 'str' could not be converted to Integer full_key: train.steps"
TYPE_ERROR = re.compile(r"Value '(.*?)' of type '\w+' could not be converted to (\w+) full_key: (\S+)")
EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def fail(message: str) -> None:
    print(f"moe-tune: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def to_config(dict_cfg):
    """DictConfig -> the plain ``Config`` dataclass that everything below cli.py takes."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(dict_cfg)
    if isinstance(cfg, dict):  # composed without the structured schema: rebuild it
        from moe_tune.config import Config

        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), dict_cfg))
    return cfg


def compose(overrides: list[str]):
    """Compose the config with Hydra's compose API (used by the pre-check, tests and the benchmark)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from moe_tune.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def precheck(argv: list[str]) -> None:
    """Compose the user's overrides; any Hydra/OmegaConf error becomes one line and exit 2."""
    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    if "-m" in argv or "--multirun" in argv:
        overrides = [o for o in overrides if "," not in o.partition("=")[2]]
    try:
        cfg = compose(overrides)
        to_config(cfg)
    except Exception as e:  # noqa: BLE001  (Hydra raises many exception types for bad overrides)
        cause = e.__cause__ or e.__context__
        msg = " ".join(str(e).split()) + (f": {' '.join(str(cause).split()[:40])}" if cause else "")
        type_error = TYPE_ERROR.search(msg)
        if type_error:
            value, expected, key = type_error.groups()
            fail(f"{key}={value!r} is not {EXPECTED.get(expected, expected)}; give {key} a value of that type")
        fail(f"{msg} (overrides: {' '.join(overrides) or 'none'}); check the key names against moe_tune/conf/")
    check_inputs(cfg)


def check_inputs(dict_cfg) -> None:
    """The values and the model files, before Hydra creates the run directory: a bad one leaves nothing written.
    (Checks that need the world size run in the trainer, before any process group.)"""
    from moe_tune.build import check_model_source
    from moe_tune.config import UserError
    from moe_tune.config.validate import check_values

    try:
        cfg = to_config(dict_cfg)
        check_values(cfg)
        check_model_source(cfg)
    except UserError as e:
        fail(str(e))


def run(dict_cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from moe_tune.config import UserError

    cfg = to_config(dict_cfg)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        # Each job of a sweep (or of a launcher such as submitit_slurm) gets its own run directory.
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    from moe_tune.dist.env import destroy_distributed
    from moe_tune.train import Trainer
    from moe_tune.train.lock import release_held

    # The process group (if the trainer made one) is torn down where every rank leaves together: a bad value
    # found once the model or data is known (exit 2, one line), a finished run, a stop on a signal. Not after
    # an error on one rank, where NCCL could wait for the others: torchrun ends those jobs.
    try:
        trainer = Trainer(cfg)
    except UserError as e:
        release_held()
        destroy_distributed()
        fail(str(e))
    try:
        trainer.fit()
    except SystemExit:
        release_held()
        destroy_distributed()
        raise
    release_held()  # the run lock on output_dir
    destroy_distributed()


def main() -> None:
    import hydra

    from moe_tune.config import register_configs

    precheck(sys.argv[1:])
    register_configs()
    hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(run)()


if __name__ == "__main__":
    main()
