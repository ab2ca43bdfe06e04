"""``python -m tests.checkpoint.slow_writer <overrides>``: moe_tune's CLI whose checkpoint writer blocks, before
writing any file, in every save from step ``SLOW_SAVE_FROM_STEP`` on until the file ``SLOW_SAVE_GATE`` exists:
a test kills the run while such a background write is in flight."""

from __future__ import annotations

import os
import time

from torch.distributed.checkpoint import FileSystemWriter

from moe_tune.checkpoint import background


class _GatedWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        while not os.path.exists(os.environ["SLOW_SAVE_GATE"]):
            time.sleep(0.05)
        return super().write_data(plan, planner)


def _writer(path: str):
    step = int(os.path.basename(os.path.normpath(path)).removeprefix("step_"))
    if step >= int(os.environ["SLOW_SAVE_FROM_STEP"]):
        return _GatedWriter(path, sync_files=True)
    return FileSystemWriter(path, sync_files=True)


if __name__ == "__main__":
    background.storage_writer = _writer  # the name the save looks up
    from moe_tune.cli.train import main

    main()
