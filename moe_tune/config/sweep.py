"""The runs of a ``-m`` sweep, each checked with its own values before the first starts.

Hydra's basic sweeper runs one job per combination of the swept values (``train.lr=1e-3,2e-3 train.steps=3,5``:
four); a bad value among them would otherwise stop the sweep only when its job came up, after the jobs before
it had trained, and a check of the values the jobs share alone misses what the swept keys complete
(``data.path=a.jsonl,b.jsonl`` chooses ``data=jsonl``, which needs a path).
"""

from __future__ import annotations


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The overrides of each job the basic sweeper runs for ``overrides``, in its order; none where another
    sweeper is chosen (``hydra/sweeper=...``: its own grammar of swept values, its own choice of jobs)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(o.lstrip("+~").startswith("hydra/sweeper") for o in overrides):
        return []
    parsed = OverridesParser.create().parse_overrides(overrides)
    if not any(o.is_sweep_override() for o in parsed):
        return []
    if any(o.is_sweep_override() and not o.is_discrete_sweep() for o in parsed):
        return []  # interval(...): the basic sweeper refuses it in its own words
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def jobs_run_here(overrides: list[str]) -> bool:
    """Whether the sweep's jobs run in this process, one after another (Hydra's basic launcher), with its world
    size and its packages; not where a launcher (``hydra/launcher=submitit_slurm``) runs them elsewhere."""
    launchers = [o.lstrip("+~").partition("=")[2] for o in overrides if o.lstrip("+~").startswith("hydra/launcher=")]
    return all(name == "basic" for name in launchers)
