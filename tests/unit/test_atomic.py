"""Atomic writes (trainer/infra/atomic.py): a file is complete or absent, and a written file gets
the permissions any new file gets (0666 less the umask), also when the writer makes its own file in
the temporary's place (safetensors' save_file does, private 0600): shared weights stay readable."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from trainer.infra.atomic import _umask, replace_atomic, write_text_atomic


@pytest.mark.parametrize("writer", ["open", "safetensors", "torch.save"])
def test_a_written_file_gets_the_permissions_of_a_new_file(tmp_path, writer):
    path = tmp_path / "out.bin"
    write = {"open": lambda tmp: tmp.write_bytes(b"x"),
             "safetensors": lambda tmp: save_file({"w": torch.zeros(2)}, str(tmp)),
             "torch.save": lambda tmp: torch.save({"w": 1}, tmp)}[writer]
    replace_atomic(path, write)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "card.json"
    write_text_atomic(path, "old")

    def fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        replace_atomic(path, fail)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["card.json"]
