"""The entry points, one module each; ``main(argv)`` returns or raises the process's exit code.

train.py   ``moe-tune`` = ``python -m moe_tune``: fine-tune (Hydra overrides, ``-m`` sweeps and launchers);
launch.py  ``python -m moe_tune.launch``: torchrun running ``moe-tune``, with the exit code a scheduler needs;
slurm.py   what ``hydra/launcher=submitit_slurm`` reports back to the submitting ``moe-tune -m``;
export.py  ``moe-tune-export``: a training checkpoint to a Hugging Face or PEFT directory;
bench.py   ``moe-tune-bench`` = ``python -m moe_tune.bench``: stacks side by side (the rows: ``moe_tune.bench``);
env.py     ``moe-tune-env`` = ``python -m moe_tune.env``: versions, GPUs and the backends that work here.

The overrides' check and composition, shared by ``moe-tune``, the torchrun launcher and the bench, are the config's
(``moe_tune.config.overrides``).
"""


def described(doc: str) -> str:
    """A module docstring as ``--help`` shows it: no reStructuredText literal quotes."""
    return doc.replace("``", "")
