"""Checkpoints: a write that dies halfway leaves the previous file loadable and no temporary; a
crafted pickle is refused and its code never runs; truncated and missing files are one line;
torch.compile (`_orig_mod.`) and DataParallel (`module.`) keys load into plain models and
back, and saved checkpoints never carry them; the safetensors export holds the network weights
alone, and its command reports a missing checkpoint in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.deploy.export import export_safetensors
from trainer.infra.checkpoint_files import clean_state_dict, load_checkpoint, load_weights
from trainer.infra.checkpoint_io import SafeCheckpointIO
from trainer.infra.errors import UserError


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))


def model():
    net = small()
    net(torch.zeros(1, 3, 6, 6))  # materialize the lazy layer
    return net


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    io, path = SafeCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)

    def dies_halfway(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    monkeypatch.undo()
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 1 and torch.equal(loaded["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary left behind


class Payload:
    """Unpickling this would create a file: code running at load time."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_whose_pickle_runs_code_is_refused_and_the_code_never_runs(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "hyper_parameters": Payload(marker)}, path)
    with pytest.raises(UserError) as refused:
        load_checkpoint(path)
    assert refused.value.line().startswith(f"{path}: refused: its pickle asks for more than tensors")
    assert not marker.exists()
    with pytest.raises(UserError):
        SafeCheckpointIO().load_checkpoint(path)
    assert not marker.exists()


def test_truncated_and_missing_files_are_one_line_errors(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1000)}}, good)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_checkpoint(cut)
    with pytest.raises(UserError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "none.ckpt")


def test_compiled_and_wrapped_keys_are_cleaned_and_load_both_ways():
    plain = model()
    compiled_keys = torch.compile(plain).state_dict()  # wrapping only: nothing is compiled until called
    wrapped_keys = nn.DataParallel(plain).state_dict()
    assert all(k.startswith("_orig_mod.") for k in compiled_keys)
    assert all(k.startswith("module.") for k in wrapped_keys)
    assert list(clean_state_dict(compiled_keys)) == list(plain.state_dict())
    assert list(clean_state_dict({f"net._orig_mod.{k}": v for k, v in plain.state_dict().items()})) == [
        f"net.{k}" for k in plain.state_dict()]

    for source in (compiled_keys, wrapped_keys, plain.state_dict()):
        for target in (model(), torch.compile(model()), nn.DataParallel(model())):
            with torch.no_grad():
                for p in target.parameters():
                    p.zero_()
            load_weights(target, source)
            inner = target.module if isinstance(target, nn.DataParallel) else getattr(target, "_orig_mod", target)
            assert all(torch.equal(a, b) for a, b in zip(inner.state_dict().values(), plain.state_dict().values()))


def test_saved_checkpoints_never_carry_prefixes(tmp_path):
    plain = model()
    SafeCheckpointIO().save_checkpoint({"state_dict": torch.compile(plain).state_dict()}, tmp_path / "c.ckpt")
    saved = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert list(saved["state_dict"]) == list(plain.state_dict())


def test_export_safetensors_holds_the_network_weights_alone(tmp_path):
    from safetensors.torch import load_file

    plain = model()
    checkpoint = {"state_dict": {f"net.{k}": v for k, v in plain.state_dict().items()}, "global_step": 7}
    SafeCheckpointIO().save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    out = export_safetensors(tmp_path / "last.ckpt", tmp_path / "model.safetensors")
    weights = load_file(str(out))
    assert set(weights) == set(plain.state_dict())
    fresh = model()
    load_weights(fresh, weights)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), plain.state_dict().values()))


def test_the_export_command_reports_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    from trainer.deploy.__main__ import main

    with pytest.raises(SystemExit) as ended:
        main(["weights", str(tmp_path / "none.ckpt"), str(tmp_path / "out.safetensors")])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'none.ckpt'}: checkpoint not found; allowed: the path of a .ckpt file")
