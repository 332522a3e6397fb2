"""data.batch_size=auto on CUDA: real training steps, doubled until one runs out of memory, then
bisected; the batch found is a multiple of 8 that trains, and the derivation lists what was tried.
(The search itself, with a fake memory cap, runs on the CPU in tests/run/test_gpu_fixtures_on_cpu.py.)"""

from __future__ import annotations

import torch

from tests.gpu.common import GPU, search_largest_batch

pytestmark = [*GPU]


def test_the_search_stops_at_what_the_memory_cap_allows():
    # The memory fraction needs a device with its index: the current one.
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 2 * 2**30 / total), device)  # about 2 GiB
    try:
        batch, how = search_largest_batch(device, image=128, limit=100_000)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert batch % 8 == 0 and batch >= 8 and batch < 100_000
    assert "out of memory" in how and f"{batch} ok" in how
