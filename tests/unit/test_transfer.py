"""The batch copy on a side stream (trainer/data/transfer.py): elsewhere than CUDA with pinned
batches it is Lightning's move, the same tensors in the same order; on CUDA (stand-in streams and
events here) the copy is issued on the side stream, an event recorded after it, the compute stream
made to wait on it before the batch is returned, and every device tensor marked as used by the
compute stream. The data module uses it only where the plan says copy_overlap, and the plan says
why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from trainer.data import transfer
from trainer.data.loader import resolve_loader
from trainer.data.transfer import SideStreamCopy, can_overlap


def nested_batch() -> dict[str, Any]:
    return {"images": torch.arange(12.0).reshape(3, 4), "pair": (torch.tensor([1, 2, 3]), torch.ones(2, 2)),
            "name": "not a tensor"}


def test_off_cuda_it_is_lightnings_move_with_the_same_tensors_in_the_same_order():
    batch = nested_batch()
    copier = SideStreamCopy()
    moved = copier(batch, torch.device("cpu"))
    assert moved["name"] == "not a tensor"
    assert torch.equal(moved["images"], batch["images"])
    assert [t.data_ptr() for t in transfer.tensors_of(moved)] == [t.data_ptr() for t in transfer.tensors_of(batch)]
    assert (copier.overlapped, copier.plain) == (0, 1)


def test_only_a_cuda_target_with_every_host_tensor_pinned_can_overlap(monkeypatch):
    batch = nested_batch()
    assert not can_overlap(batch, torch.device("cpu"))
    assert not can_overlap(batch, torch.device("cuda", 0))  # nothing pinned here
    monkeypatch.setattr(transfer, "_pinned", lambda t: t.dtype == torch.float32)  # the int tensor is not
    assert not can_overlap(batch, torch.device("cuda", 0))
    monkeypatch.setattr(transfer, "_pinned", lambda t: True)
    assert can_overlap(batch, torch.device("cuda", 0))
    assert not can_overlap(("no tensors",), torch.device("cuda", 0))
    assert not can_overlap(batch, torch.device("mps"))


class Recorded(torch.Tensor):
    """A tensor that notes `record_stream` calls in the fake CUDA's log instead of making them."""

    log: list[tuple[str, ...]]

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        self.log.append(("record_stream", stream.name, str(self.shape)))


@dataclass
class FakeStream:
    name: str
    log: list[tuple[str, ...]]

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.append(("wait_event", self.name, event.recorded_on))


class FakeEvent:
    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log, self.recorded_on = log, ""

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.name
        self.log.append(("record_event", stream.name))


class FakeCuda:
    """What SideStreamCopy uses of torch.cuda, logging the order of the calls."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.active = "compute"
        self.compute = FakeStream("compute", self.log)
        self.made: list[FakeStream] = []

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.compute

    def current_device(self) -> int:
        return 0

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 - torch.cuda's name
        stream = FakeStream(f"side{len(self.made)}", self.log)
        self.made.append(stream)
        return stream

    def Event(self) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        return FakeEvent(self.log)

    def stream(self, stream: FakeStream) -> Any:
        cuda = self

        class Context:
            def __enter__(self) -> None:
                cuda.before, cuda.active = cuda.active, stream.name

            def __exit__(self, *exc: object) -> None:
                cuda.active = cuda.before

        return Context()


def fake_cuda_copier(monkeypatch: pytest.MonkeyPatch) -> tuple[SideStreamCopy, FakeCuda]:
    monkeypatch.setattr(transfer, "_pinned", lambda t: True)
    cuda = FakeCuda()

    def move(batch: Any, device: torch.device) -> Any:
        cuda.log.append(("copy", cuda.active))

        def to_device(t: torch.Tensor) -> torch.Tensor:
            moved = t.clone().as_subclass(Recorded)
            moved.log = cuda.log
            return moved

        return transfer.apply_to_collection(batch, torch.Tensor, to_device)

    return SideStreamCopy(cuda=cuda, move=move), cuda


def test_on_cuda_the_copy_runs_on_the_side_stream_and_the_step_waits_for_it(monkeypatch):
    copier, cuda = fake_cuda_copier(monkeypatch)
    batch = nested_batch()
    moved = copier(batch, torch.device("cuda", 0))
    assert cuda.log[:3] == [("copy", "side0"), ("record_event", "side0"), ("wait_event", "compute", "side0")]
    # Every device tensor marked as read by the compute stream, after the wait and before returning.
    assert cuda.log[3:] == [("record_stream", "compute", str(t.shape)) for t in transfer.tensors_of(batch)]
    assert cuda.active == "compute"  # the side stream is left once the copy is issued
    assert moved["name"] == "not a tensor"
    assert all(torch.equal(a, b) for a, b in zip(transfer.tensors_of(moved), transfer.tensors_of(batch)))
    assert (copier.overlapped, copier.plain) == (1, 0)


def test_one_side_stream_per_device_made_once(monkeypatch):
    copier, cuda = fake_cuda_copier(monkeypatch)
    for _ in range(3):
        copier(nested_batch(), torch.device("cuda", 0))
    copier(nested_batch(), torch.device("cuda", 1))
    assert [s.name for s in cuda.made] == ["side0", "side1"]
    assert copier.overlapped == 4


def test_a_copy_of_the_copier_drops_its_streams(monkeypatch):
    import copy
    import pickle

    copier, _ = fake_cuda_copier(monkeypatch)
    copier(nested_batch(), torch.device("cuda", 0))
    assert copy.deepcopy(SideStreamCopy())._streams == {}
    assert pickle.loads(pickle.dumps(SideStreamCopy()))._streams == {}
    assert copier.__getstate__()["_streams"] == {}


def test_auto_overlaps_with_cuda_and_pinned_batches_and_says_why():
    def decide(request: Any, cuda: bool, pin: Any = "auto", in_memory: bool = False) -> Any:
        settings = resolve_loader(0, pin, "auto", "auto", in_memory=in_memory, cuda=cuda, cpus=2,
                                  copy_overlap=request)
        return settings.copy_overlap, settings.reasons["copy_overlap"]

    assert decide("auto", cuda=True) == (True, "auto -> true (CUDA, pinned batches: the copy of the next batch "
                                                "overlaps this step's compute)")
    assert decide("auto", cuda=False) == (False, "auto -> false (no CUDA)")
    assert decide("auto", cuda=True, in_memory=True)[0] is False  # in-memory data are not pinned on auto
    assert "not pinned" in decide("auto", cuda=True, pin=False)[1]
    assert decide(False, cuda=True) == (False, "false (as configured)")
    assert decide(True, cuda=False) == (False, "false (true as configured; no CUDA: nothing to overlap)")
    assert decide(True, cuda=True, pin=False) == (True, "true (as configured; batches not pinned: each is moved "
                                                        "as Lightning does)")


def test_the_data_module_copies_on_the_side_stream_only_where_the_plan_says(monkeypatch):
    from trainer.data.digits import DigitsDataModule

    dm = DigitsDataModule(copy_overlap=True, pin_memory=True)
    calls: list[str] = []
    monkeypatch.setattr(SideStreamCopy, "__call__", lambda self, batch, device: calls.append("side") or batch)
    batch = (torch.zeros(2, 1, 8, 8, dtype=torch.uint8), torch.tensor([0, 1]))
    dm.apply_loader(dm.loader_settings(cuda=False))  # a CPU plan: off
    assert dm.transfer_batch_to_device(batch, torch.device("cpu"), 0) is not None and calls == []
    dm.apply_loader(dm.loader_settings(cuda=True))
    dm.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert calls == ["side"]
