"""The deployment layer on CUDA: the torch.export program that `serve` runs on the GPU gives ONNX
Runtime's probabilities (CPU) on the same normalized images, and `bench` times the compiled variant
beside eager, folded and ONNX Runtime with the device synchronized."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import GPU
from tests.helpers import run_in_process
from trainer.deploy.export import export_run
from trainer.deploy.preprocess import Normalizer
from trainer.deploy.serve import Runtime, read_card

pytestmark = [*GPU]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("digits_cuda")
    run_in_process(["trainer.max_epochs=1", "progress=plain"], run_dir)
    return run_dir, export_run(run_dir).folder


def test_the_program_on_cuda_gives_onnxruntimes_probabilities(exported):
    _, folder = exported
    card, preprocessing = read_card(folder)
    pixels = torch.randint(0, 256, (16, preprocessing.channels, *preprocessing.output_size), dtype=torch.uint8)
    on_gpu = Runtime(folder, "torch", torch.device("cuda"))(Normalizer(preprocessing, "cuda")(pixels))
    on_cpu = Runtime(folder, "onnxruntime", torch.device("cpu"))(Normalizer(preprocessing)(pixels))
    assert on_gpu.shape == (16, len(card["classes"])) and torch.allclose(on_gpu, on_cpu, atol=1e-3)


def test_bench_on_cuda_times_the_compiled_variant(exported):
    from trainer.deploy.bench import bench_run

    run_dir, _ = exported
    timings, _ = bench_run(run_dir, batch_sizes=(1, 32), warmup=3, calls=10, budget_s=1.0, device="cuda")
    assert {t.variant for t in timings} == {"eager", "folded", "compiled", "onnxruntime"}
    assert all(0 < t.p50_ms <= t.p99_ms for t in timings)
