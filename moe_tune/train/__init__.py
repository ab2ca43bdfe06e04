"""Training: ``Trainer`` (trainer.py) and the small objects its loop calls.

trainer.py   Trainer: a model from an injected builder, train_step(), the loop
cadence.py   Cadence: which steps log, evaluate, draw, save a checkpoint and synchronize the host
evaluate.py  evaluate: the held-out loss over every validation token of all ranks (eval mode, no_grad)
rows.py      metrics_rows: a sync step's device values, read in one host sync, as metrics.jsonl rows
guard.py     NonFiniteGuard: device-side counts of steps skipped for a non-finite gradient norm
signals.py   StopSignal: SIGTERM/SIGUSR1/SIGINT/SIGHUP/SIGQUIT, agreed by every rank on the same step
profile.py   build_profiler: train.profile=true traces steps 7-9 (as logged) on rank 0
progress.py  Progress: rank 0's bar or log lines
"""

from moe_tune.train.cadence import Cadence
from moe_tune.train.guard import Diverged, NonFiniteGuard
from moe_tune.train.signals import StopSignal
from moe_tune.train.trainer import Trainer

__all__ = ["Cadence", "Diverged", "NonFiniteGuard", "StopSignal", "Trainer"]
