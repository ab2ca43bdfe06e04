"""Experiment tracking beside metrics.jsonl: ``logger=none|tensorboard|wandb|mlflow``.

``build_logger(cfg.logger, output_dir, rank, config_dict) -> Logger``; a ``Logger`` has ``log(step, row)`` (the
numeric fields of a metrics row, plus anything else numeric such as ``expert_load/layer_<i>``, i the decoder layer),
``log_image(step, name, image)`` (an HxWx3 uint8 array or a matplotlib Figure) and ``close()``. Only rank 0
logs: every other rank, and ``logger=none``, get the base ``Logger``, which does nothing.

base.py      Logger (the interface, and the one that does nothing), scalars and flatten (rows and config for
             the trackers)
backends.py  TensorBoardLogger (torch.utils.tensorboard), WandbLogger (offline by default), MlflowLogger (a file
             store); each imports its package only when chosen
heatmap.py   expert_load_image: the layers x experts load as an image (matplotlib)

A chosen backend whose package is missing fails before the run starts (``require_logger``), as one line naming
the package and the command that installs just it; so does ``logger=wandb logger.mode=online`` without W&B
credentials (wandb.init would stop the run with a traceback once the model is built and output_dir written).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import os

from moe_tune.config import ConfigError, LoggerConfig
from moe_tune.loggers.base import Logger, flatten, scalars

# The package each backend imports (torch.utils.tensorboard needs the tensorboard package).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# The extra of pyproject.toml that installs that package alone (``track`` brings every tracker and matplotlib).
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _wandb_logged_in() -> bool:
    """Whether W&B finds credentials here (WANDB_API_KEY, its settings, .netrc) without prompting or a network call.
    True where the installed wandb cannot say so (an older ``wandb.login`` that takes no ``prompt``)."""
    import wandb

    if "prompt" not in inspect.signature(wandb.login).parameters:
        return True
    with contextlib.redirect_stderr(io.StringIO()):  # its "Loaded credentials" lines
        return bool(wandb.login(verify=False, prompt=False))


def require_logger(cfg: LoggerConfig) -> None:
    """ConfigError (exit 2, one line) if ``cfg`` asks for a package that is not installed, or for W&B online
    without credentials. Cheap: no import, except wandb's for ``logger.mode=online``."""
    package = PACKAGES.get(cfg.name)
    if package is not None and not _installed(package):
        install = f"pip install 'moe_tune[{EXTRAS[cfg.name]}]'"
        raise ConfigError(f"logger={cfg.name} needs the {package} package: {install}; or logger=none")
    if cfg.name != "none" and cfg.expert_load_image_every > 0 and not _installed("matplotlib"):
        raise ConfigError(
            f"logger.expert_load_image_every={cfg.expert_load_image_every} draws with matplotlib, which is not "
            f"installed: pip install matplotlib; or logger.expert_load_image_every=0"
        )
    if cfg.name == "wandb" and cfg.mode == "online" and not _wandb_logged_in():
        raise ConfigError(
            "logger=wandb logger.mode=online needs W&B credentials and none are configured here: run `wandb login` "
            "or set WANDB_API_KEY; or logger.mode=offline (then `wandb sync` uploads the run)"
        )


def build_logger(cfg: LoggerConfig, output_dir: str, rank: int, config_dict: dict, start_step: int = 0) -> Logger:
    """Rank 0's logger for ``cfg.name`` writing under ``cfg.log_dir`` (default ``<output_dir>/<name>``), with
    ``config_dict`` (the resolved config) as the run's parameters; the do-nothing ``Logger`` elsewhere.
    ``start_step``: the step training resumes after (0: a fresh start). A resumed run continues the tracker's run
    of the same ``log_dir`` (W&B and MLflow by the run id kept there), and TensorBoard hides what an interrupted
    attempt logged past the checkpoint, so each step is shown once."""
    if rank != 0 or cfg.name == "none":
        return Logger()
    require_logger(cfg)
    from moe_tune.loggers.backends import BACKENDS

    log_dir = cfg.log_dir or os.path.join(output_dir, cfg.name)
    os.makedirs(log_dir, exist_ok=True)
    return BACKENDS[cfg.name](cfg, log_dir, config_dict, start_step)


__all__ = ["EXTRAS", "Logger", "build_logger", "flatten", "require_logger", "scalars"]
