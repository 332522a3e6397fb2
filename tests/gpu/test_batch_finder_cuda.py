"""data.batch_size=auto on CUDA: real training steps, doubled until one runs out of memory, then
bisected; the batch found is a multiple of 8 that trains, and the derivation lists what was tried."""

from __future__ import annotations

import contextlib

import torch

from tests.gpu.common import GPU
from trainer.measure.memory import largest_batch_that_runs

pytestmark = [*GPU]


def test_the_search_stops_at_what_the_memory_cap_allows():
    device = torch.device("cuda")
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))

    def make_batch(size):
        return torch.randn(size, 3, 128, 128, device=device), torch.randint(0, 10, (size,), device=device)

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 2 * 2**30 / total), device)  # about 2 GiB
    try:
        batch, how = largest_batch_that_runs(net, lambda n: torch.optim.SGD(n.parameters(), lr=0.1), make_batch,
                                             torch.nn.functional.cross_entropy, contextlib.nullcontext, device, 8,
                                             limit=100_000)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert batch % 8 == 0 and batch >= 8 and batch < 100_000
    assert "out of memory" in how and f"{batch} ok" in how
