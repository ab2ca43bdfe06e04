"""moe_tune's Hydra launcher plugin (``hydra/launcher=submitit_slurm``): see ``moe_tune.cli.slurm``."""
