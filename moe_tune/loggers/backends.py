"""The trackers behind ``moe_tune.loggers.Logger``; each imports its package in its constructor, so choosing one
never imports another. ``require_logger`` has checked that the package is installed."""

from __future__ import annotations

import os
import threading
import time

from moe_tune.config import LoggerConfig
from moe_tune.loggers.base import Logger, flatten, scalars

RUN_ID = "run_id"  # the tracker's run id in log_dir: a resumed training run continues that run


def _run_id(log_dir: str, start_step: int) -> str | None:
    """The id kept in ``log_dir`` when training resumes (None on a fresh start, or if none was kept)."""
    path = os.path.join(log_dir, RUN_ID)
    if start_step == 0 or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _keep_run_id(log_dir: str, run_id: str) -> None:
    with open(os.path.join(log_dir, RUN_ID), "w") as f:
        f.write(run_id + "\n")


def _rgb(image):
    """An HxWx3 uint8 array from an array or a matplotlib Figure."""
    if hasattr(image, "canvas"):
        from moe_tune.loggers.heatmap import figure_to_array

        return figure_to_array(image)
    return image


class TensorBoardLogger(Logger):
    """Event files in ``log_dir`` (``tensorboard --logdir <log_dir>``); each metrics field is a scalar tag of its
    own name, the config a text summary (at the step the run starts from). ``purge_step``: TensorBoard drops
    the events of earlier files at steps after ``start_step`` (an interrupted attempt's, or an earlier run's).

    The events are written by TensorBoard's writer thread; a write that fails there (a full disk) ends the thread,
    whose error TensorBoard raises again at this logger's next call, where the run's one line for it is said.
    ``_quiet_writer_thread`` keeps the thread's own traceback from being printed beside that line."""

    def __init__(self, cfg: LoggerConfig, log_dir: str, config: dict, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self._previous_hook = threading.excepthook
        threading.excepthook = self._quiet_writer_thread
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=start_step + 1)
        lines = "\n".join(f"    {k} = {v!r}" for k, v in flatten(config).items())  # indented: markdown code block
        self.writer.add_text("config", lines, start_step)

    def log(self, step: int, row: dict) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, step)

    def log_image(self, step: int, name: str, image) -> None:
        self.writer.add_image(name, _rgb(image), step, dataformats="HWC")

    def _quiet_writer_thread(self, args) -> None:
        """threading.excepthook while this logger is open: TensorBoard's writer thread (``_AsyncWriterThread``)
        keeps its exception for the next write, flush or close to raise; every other thread's prints as before."""
        if type(args.thread).__name__ != "_AsyncWriterThread":
            self._previous_hook(args)

    def close(self) -> None:
        try:
            self.writer.close()  # raises a write's error that the writer thread kept
        finally:
            if threading.excepthook == self._quiet_writer_thread:
                threading.excepthook = self._previous_hook


class WandbLogger(Logger):
    """A W&B run in ``log_dir/wandb``: ``logger.mode=offline`` (the default) writes it locally with no network
    (``wandb sync <dir>`` uploads it later); ``online`` needs a login. A resumed training run resumes the W&B run
    whose id ``log_dir/run_id`` keeps."""

    def __init__(self, cfg: LoggerConfig, log_dir: str, config: dict, start_step: int = 0):
        import wandb

        self.wandb = wandb
        run_id = _run_id(log_dir, start_step)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.run_name,
            dir=log_dir,
            mode=cfg.mode,
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(console="off", silent=True),  # leave stdout/stderr to moe_tune's own logging
        )
        _keep_run_id(log_dir, self.run.id)

    def log(self, step: int, row: dict) -> None:
        self.run.log(scalars(row), step=step)

    def log_image(self, step: int, name: str, image) -> None:
        self.run.log({name: self.wandb.Image(_rgb(image))}, step=step)

    def close(self) -> None:
        self.run.finish()
        if self.wandb.run is None:
            # finish() can return before wandb's service has written the run file (seen with wandb 0.31 offline:
            # read right after, the file held only its header); teardown waits for it, as it would at exit.
            self.wandb.teardown()


class MlflowLogger(Logger):
    """An MLflow run in a file store at ``log_dir`` (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
    <log_dir>``): experiment ``logger.project``, the flattened config as parameters.

    MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (its database stores need SQLAlchemy,
    which mlflow-skinny lacks); this sets it for this process unless it is set already. A resumed training run
    logs into the MLflow run whose id ``log_dir/run_id`` keeps (running again)."""

    def __init__(self, cfg: LoggerConfig, log_dir: str, config: dict, start_step: int = 0):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri="file:" + os.path.abspath(log_dir))
        exp = self.client.get_experiment_by_name(cfg.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.project)
        self.run_id = _run_id(log_dir, start_step)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return  # its parameters are logged (MLflow refuses to change a logged parameter)
        self.run_id = self.client.create_run(exp_id, run_name=cfg.run_name).info.run_id
        _keep_run_id(log_dir, self.run_id)
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]  # MLflow's value length limit
        for i in range(0, len(params), 100):  # at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_image(self, step: int, name: str, image) -> None:
        self.client.log_image(self.run_id, _rgb(image), key=name, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS: dict[str, type[Logger]] = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}

__all__ = ["BACKENDS", "MlflowLogger", "TensorBoardLogger", "WandbLogger"]
