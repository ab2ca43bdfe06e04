"""A resume onto training data that changed in place (records added to, removed from or edited in data.path's
files, with every data setting the checkpoint's): the remaining steps read other rows in another order, so the
epoch under way trains some records again and skips others. The resume says so, as it names other data settings."""

from __future__ import annotations

import json
import logging

import pytest

from tests.harness import copy_checkpoint


class _Warnings(logging.Handler):
    """The moe_tune logger's warnings (the Trainer reconfigures the root logger's handlers: caplog would miss them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    handler, logger = _Warnings(), logging.getLogger("moe_tune")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _write(path, first: int, n: int) -> None:
    with open(path, "a") as f:
        for i in range(first, first + n):
            record = [
                {"role": "user", "content": f"R{i:04d}" + "x" * (i % 7)},
                {"role": "assistant", "content": f"a{i}"},
            ]
            f.write(json.dumps({"messages": record}) + "\n")


def test_a_resume_onto_data_changed_in_place_says_so(tmp_path, make_trainer, warnings_logged):
    """Trained 2 steps on 12 records, saved at step 2; resumed with the same files: nothing said. Resumed after 3
    records were appended to the same file: one warning naming data.path, the checkpoint and the counts then and now,
    and the run continues from step 2 (as with any other data setting)."""
    data, first, same, changed = (tmp_path / n for n in ("chat.jsonl", "first", "same", "changed"))
    _write(data, 0, 12)
    common = [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "checkpoint.every=2"]
    make_trainer("train.steps=2", *common, out=first).fit()
    copy_checkpoint(first, same, 2)
    copy_checkpoint(first, changed, 2)
    assert make_trainer("train.steps=4", *common, out=same).step == 2
    assert warnings_logged == []
    _write(data, 100, 3)
    assert make_trainer("train.steps=4", *common, out=changed).step == 2
    warned = warnings_logged
    assert len(warned) == 1, warned
    assert warned[0].startswith(
        f"data.path {data} now makes other rows than when {changed / 'checkpoints' / 'step_2'} was saved (then 12 "
        "records in "
    ), warned[0]
    assert "; now 15 records in " in warned[0] and "put them back as they were" in warned[0], warned[0]
