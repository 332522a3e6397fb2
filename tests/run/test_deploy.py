"""python -m trainer.deploy export and bench: from a short digits run, the ONNX model, the torch.export program
and the folded network give PyTorch's logits on real evaluation images; the model card holds the
classes, the preprocessing, the run's accuracy and the checkpoint's hash; bad input is one line."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers import python_forked
from trainer.deploy.export import TOLERANCE, checked_eval, export_run, onnx_logits, program_logits
from trainer.infra.errors import UserError

pytestmark = pytest.mark.run


def test_export_writes_models_that_agree_with_pytorch(digits_run, tmp_path):
    """Each exported form, run again here on a fresh batch size, gives the folded network's logits;
    the card names the best checkpoint by hash and carries the run's test accuracy."""
    run_dir, summary = digits_run
    exported = export_run(run_dir, out=tmp_path / "export")
    assert exported.checkpoint == type(exported.checkpoint)(summary["best_checkpoint"])
    assert all(diff <= TOLERANCE for diff in exported.max_abs_diff.values()) and exported.images_checked == 64
    assert exported.folded_modules[1] < exported.folded_modules[0]  # Conv-BN pairs folded
    card = json.loads((tmp_path / "export" / "model.json").read_text())
    assert card["classes"] == [str(d) for d in range(10)] and card["input"]["shape"] == [1, 8, 8]
    assert card["accuracy"]["test"] == summary["metrics"]["test"]["acc"]
    assert card["checkpoint"]["sha256"] == hashlib.sha256(exported.checkpoint.read_bytes()).hexdigest()
    assert card["preprocessing"]["scale"] == 1 / 255 and len(card["preprocessing"]["mean"]) == 1
    assert (card["preprocessing"]["color"], card["preprocessing"]["resize"]) == ("L", [8, 8])
    images = torch.randn(5, 1, 8, 8)  # a batch size the export never saw: the batch is dynamic
    from_program = program_logits(tmp_path / "export" / "model.pt2", images)
    from_onnx = onnx_logits(tmp_path / "export" / "model.onnx", images)
    assert from_program.shape == (5, 10) and torch.allclose(from_onnx, from_program, atol=1e-4)
    weights = load_file(str(tmp_path / "export" / "weights.safetensors"))
    assert any(k.endswith("running_mean") for k in weights)  # the trained, unfolded weights


class _StuckDropout(nn.Dropout):
    def train(self, mode: bool = True) -> "_StuckDropout":
        return super().train(True)  # ignores eval()


class _RandomForward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, training=True)


class _BatchStatistics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(x, self.bn.running_mean, self.bn.running_var, training=True)


@pytest.mark.parametrize("net,says", [
    (nn.Sequential(nn.Linear(4, 4), _StuckDropout(0.5)), "still in training mode after eval(): 1"),
    (_RandomForward(), "something is still random"),
    (_BatchStatistics(), "changed bn.running_mean"),
])
def test_a_network_not_ready_for_inference_is_refused_naming_the_module(net, says):
    with pytest.raises(UserError, match="model: ") as raised:
        checked_eval(net, torch.randn(8, 4))
    assert says in str(raised.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return python_forked(["-m", "trainer.deploy", "export", *args])


def test_what_is_not_a_run_or_not_this_models_checkpoint_is_one_line(digits_run, tmp_path, capsys):
    """A folder that is not a run, an unknown format, and a checkpoint of another model: exit 2 and
    one line naming the path; the first through the real command line, the others through the same
    entry point in this process (an interpreter start each would cost 8 s)."""
    from trainer.deploy.__main__ import main

    run_dir, _ = digits_run
    result = _cli(str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "is not a run folder" in lines[0], lines
    (tmp_path / "notes.txt").write_text("x")
    foreign = run_dir / "checkpoints" / "foreign.ckpt"
    torch.save({"state_dict": {"net.head.weight": torch.zeros(3, 3)}}, foreign)
    try:
        for path, says in ((tmp_path / "notes.txt", "unknown format"), (foreign, "does not fit the run's model")):
            capsys.readouterr()
            with pytest.raises(SystemExit) as ended:
                main(["export", str(path)])
            assert ended.value.code == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    finally:
        foreign.unlink()


def test_bench_times_every_variant_at_every_batch_size(digits_run):
    """eager, folded and ONNX Runtime (compiled only on CUDA) at each batch size, percentiles in order,
    markdown, json and png in the run folder."""
    from trainer.deploy.bench import bench_run

    run_dir, _ = digits_run
    # A budget no busy machine runs out of: the 7 calls are the count under test, not the clock.
    timings, markdown = bench_run(run_dir, batch_sizes=(1, 4), warmup=2, calls=7, budget_s=120, device="cpu")
    assert {(t.variant, t.batch) for t in timings} == {(v, b) for v in ("eager", "folded", "onnxruntime") for b in (1, 4)}
    assert all(0 < t.p50_ms <= t.p90_ms <= t.p99_ms and t.calls == 7 for t in timings)
    assert "| 4 | onnxruntime |" in markdown.read_text()
    record = json.loads((run_dir / "deploy_bench.json").read_text())
    assert len(record["timings"]) == 6
    assert (run_dir / "deploy_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_with_a_bad_batch_list_is_one_line(digits_run, capsys):
    from trainer.deploy.__main__ import main

    run_dir, _ = digits_run
    with pytest.raises(SystemExit) as ended:
        main(["bench", str(run_dir), "--batch-sizes", "1,x"])
    assert ended.value.code == 2 and capsys.readouterr().err.strip() == (
        "error: --batch-sizes: '1,x' is not a list of positive integers; allowed: e.g. 1,8,32,128")
