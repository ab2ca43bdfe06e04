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

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

# A reader that closes the pipe early (``moe-tune-env | head``) ends a printing command as SIGPIPE would: quietly,
# with the shell's code for it (128 + 13).
EXIT_CLOSED_PIPE = 141


def quiet_on_closed_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """``main`` that stops quietly when its reader has gone, instead of printing a BrokenPipeError traceback.

    stdout is pointed at /dev/null before returning, so that the interpreter's last flush of what was still buffered
    does not raise again at exit.
    """

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_CLOSED_PIPE

    return wrapped


def described(doc: str) -> str:
    """A module docstring as ``--help`` shows it: no reStructuredText literal quotes."""
    return doc.replace("``", "")
