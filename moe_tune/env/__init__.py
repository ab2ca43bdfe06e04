"""What this machine offers moe_tune: versions, GPUs, and which backends work here.

  backends.py  ``unusable_reason`` (cheap: installed? GPU? compute capability?), ``require_backends(cfg)`` (the
               start-of-run check) and ``probe`` (runs a tiny call of the backend);
  probes.py    the tiny runs ``probe`` calls;
  report.py    ``versions()``, ``gpus()``, ``collect()``: what ``moe-tune-env`` (``moe_tune.cli.env``) prints.

``import moe_tune.env`` imports no torch and no backend: they load inside the functions.
"""

from moe_tune.env.backends import BACKENDS, probe, require_backends, unusable_reason
from moe_tune.env.report import collect, versions

__all__ = ["BACKENDS", "collect", "probe", "require_backends", "unusable_reason", "versions"]
