"""The loader rules behind `data.*=auto`: workers = usable CPUs - 1, at most 8, and none for
in-memory data; pinning only with CUDA; persistent workers only with workers; the prefetch depth
bounded so the batches in flight stay under 10% of available memory; each choice with its reason."""

from trainer.data.loader import resolve_loader


def test_auto_workers_leave_a_cpu_for_the_training_loop_and_cap_at_eight():
    assert resolve_loader("auto", "auto", "auto", "auto", in_memory=False, cuda=False, cpus=2).num_workers == 1
    assert resolve_loader("auto", "auto", "auto", "auto", in_memory=False, cuda=False, cpus=1).num_workers == 0
    assert resolve_loader("auto", "auto", "auto", "auto", in_memory=False, cuda=True, cpus=64).num_workers == 8


def test_in_memory_data_gets_no_workers_and_no_pinning():
    s = resolve_loader("auto", "auto", "auto", "auto", in_memory=True, cuda=True, cpus=16)
    assert (s.num_workers, s.pin_memory, s.persistent_workers, s.prefetch_factor) == (0, False, False, None)
    assert "in memory" in s.reasons["num_workers"]
    assert s.dataloader_kwargs() == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}


def test_pinning_only_with_cuda_and_persistence_only_with_workers():
    gpu = resolve_loader("auto", "auto", "auto", "auto", in_memory=False, cuda=True, cpus=4)
    cpu = resolve_loader("auto", "auto", "auto", "auto", in_memory=False, cuda=False, cpus=4)
    assert gpu.pin_memory and not cpu.pin_memory
    assert gpu.persistent_workers and gpu.prefetch_factor == 2
    forced = resolve_loader(0, True, True, 4, in_memory=False, cuda=False, cpus=4)
    assert forced.pin_memory and not forced.persistent_workers and forced.prefetch_factor is None
    assert "needs workers > 0" in forced.reasons["persistent_workers"]


def test_prefetch_is_bounded_by_available_memory():
    mib = 2**20
    plenty = resolve_loader(4, "auto", "auto", "auto", in_memory=False, cuda=True, cpus=8,
                            batch_bytes=10 * mib, available_bytes=64 * 2**30)
    assert plenty.prefetch_factor == 2
    # 4 workers x 1 batch of 100 MiB already uses the whole 10% of 4 GiB: one batch each, not two.
    tight = resolve_loader(4, "auto", "auto", "auto", in_memory=False, cuda=True, cpus=8,
                           batch_bytes=100 * mib, available_bytes=4 * 2**30)
    assert tight.prefetch_factor == 1
    assert "budget 10% of 4.0 GiB" in tight.reasons["prefetch_factor"]
