"""Training from shards, local and on a real S3-compatible server (tests/s3_server.py).

A photo folder becomes shards in a folder and, through the command line, in the test bucket. A run
trains from the local shards with every decode mode, and from the bucket through a size-limited
cache. Killed with SIGKILL two batches into its second epoch and resumed with resume=auto, a run from
shards ends with the weights of the uninterrupted run, tensor for tensor. Two processes reading the
shards see disjoint shares that together cover the training split. Wrong credentials, a missing
bucket, a store that cannot be reached and a damaged shard each end the run in one line naming the
source, with no checkpoint written.

Real processes (a server, forked runs, two ranks, torchrun): marked slow; CI runs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import (ON_CPU, REPO, ForkedRun, launch_with_forked_ranks, python_forked, train_forked,
                           write_photo_jpegs)
from tests.run.test_resume import kill_at_step, weights

pytest.importorskip("litdata")
pytest.importorskip("moto")

pytestmark = [pytest.mark.run, pytest.mark.slow]

# 3 classes x 12 photos: 36 training images, 9 steps of 4 an epoch, 2 epochs.
RUN = [*ON_CPU, "data=shards", "data.image_size=32", "data.batch_size=4", "data.num_workers=1", "model=small_cnn",
       "trainer.max_epochs=2", "trainer.deterministic=true", "checkpointing.every_n_steps=2", "progress=off",
       "trainer.log_every_n_steps=1",
       "logger=csv"]
STEPS = 18


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    write_photo_jpegs(root, {"train": 12, "val": 4}, classes=3, size=(96, 72))
    return root


@pytest.fixture(scope="module")
def local_shards(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.data.prepare_shards import prepare_shards

    dst = tmp_path_factory.mktemp("local") / "shards"
    prepare_shards(folder, str(dst), workers=1, chunk_mb=1, progress=False)
    return dst


@pytest.fixture(scope="module")
def s3(folder: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests import s3_server

    server = s3_server.start(tmp_path_factory.mktemp("s3"))
    try:
        env = {**os.environ, **server.env()}
        # The command as typed, forked from this process (no new import of torch and Lightning): the
        # store's settings are read from the environment when the client is made, not at start-up.
        written = python_forked(["-m", "trainer.data.prepare", str(folder), f"s3://{s3_server.BUCKET}/photos",
                                 "--format", "shards", "--chunk-mb", "1", "--workers", "2", "--quiet"], env=env,
                                timeout=300)
        assert written.returncode == 0, written.stderr[-3000:]
        assert "wrote shards of 48 images" in written.stdout
        yield server
    finally:
        server.stop()


def _one_line(result, where: str, trained: bool = False) -> str:  # type: ignore[no-untyped-def]
    """The run's one error line; no checkpoint unless it `trained` first, and then only whole ones."""
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}"), result
    assert "Traceback" not in result.stderr + result.stdout
    saved = sorted((result.run_dir / "checkpoints").glob("*")) if (result.run_dir / "checkpoints").exists() else []
    assert bool(saved) == trained, saved
    for path in saved:  # every file there is a whole checkpoint: none half-written, no temporary left
        assert path.suffix == ".ckpt" and "state_dict" in torch.load(path, map_location="cpu", weights_only=False)
    return lines[0]


@pytest.mark.parametrize("decode", ["pil", "fast", "device"])
def test_trains_from_local_shards_with_every_decode_mode(local_shards, tmp_path, decode):
    result = train_forked([*RUN, f"data.source={local_shards}", f"data.decode={decode}", "trainer.max_epochs=1",
                           f"run.root={tmp_path}"], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["steps"] == STEPS // 2 and summary["data"]["sizes"]["train"] == 36
    assert summary["metrics"]["test"]["acc"] > 0  # evaluated on the val split's 12 images


def test_killed_mid_epoch_and_resumed_from_shards_equals_the_uninterrupted_run(local_shards, tmp_path):
    args = [*RUN, f"data.source={local_shards}", f"run.root={tmp_path}", "run.name=shards"]
    reference = train_forked(args, tmp_path / "reference")
    assert reference.returncode == 0 and reference.summary["steps"] == STEPS, reference
    # killed at step 12: last.ckpt of step 10, one batch into the second epoch
    killed = train_forked(args, tmp_path / "killed", setup=kill_at_step(12))
    assert killed.returncode == -signal.SIGKILL, killed
    position = torch.load(tmp_path / "killed" / "checkpoints" / "last.ckpt", map_location="cpu",
                          weights_only=False)["ShardsDataModule"]["stream_position"]
    assert position["taken"] == 1 and position["litdata"]["current_epoch"] == 2
    resumed = train_forked([*args, "resume=auto"], tmp_path / "killed")
    assert resumed.returncode == 0, resumed
    assert resumed.summary["resumed_from"]["global_step"] == 10 and resumed.summary["resumed_from"]["mid_epoch"]
    expected = weights(tmp_path / "reference" / "checkpoints" / "last.ckpt")
    got = weights(tmp_path / "killed" / "checkpoints" / "last.ckpt")
    different = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


SHARE_SCRIPT = """
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
from trainer.data.shards import ShardsDataModule, ShardStream
ShardStream.decoded = lambda self, item: int(item["index"])  # each sample's place in the folder, not its image
data = ShardsDataModule(source=sys.argv[1], decode="fast", image_size=32, batch_size=4, num_workers=1)
data.setup()
seen = [index for index, _ in data.train_set]
print(json.dumps({"rank": dist.get_rank(), "seen": seen}))
"""


def test_two_processes_read_disjoint_shares_that_cover_the_training_split(local_shards, tmp_path):
    """Two ranks of one process group (gloo, met through env:// as torchrun's ranks meet: MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE), each a forked child of this process running the script: the claim
    is what each rank's data module reads, not the launch (the two-node test below is torchrun's)."""
    script = tmp_path / "share.py"
    script.write_text(SHARE_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(ForkedRun([str(script), str(local_shards)], cwd=tmp_path,
                                               env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
                 for rank in (0, 1)]
        results = [rank.wait(300) for rank in ranks]
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for result in results for line in result.stdout.splitlines() if line.startswith("{")]
    shares = {row["rank"]: row["seen"] for row in rows}
    assert set(shares) == {0, 1} and len(shares[0]) == len(shares[1]) == 18
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(36))


TWO_NODES = ["trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2", "run.name=two_nodes"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(args: list[str], root: Path, node1: tuple[str, ...] = (), timeout: float = 300) -> list[tuple]:
    """Two launches of one process each, node ranks 0 and 1, meeting on the loopback address as two
    hosts would (torchrun's static rendezvous: MASTER_ADDR, NODE_RANK, WORLD_SIZE); (rc, stderr) each.
    Each torchrun is forked from this process into a process group of its own, and the rank each
    starts is forked from this process through the interpreter torchrun is given
    (tests.helpers.launch_with_forked_ranks): no new interpreter imports torch and Lightning."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    done = launch_with_forked_ranks([["-m", "torch.distributed.run", "--nnodes=2",
                                      f"--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                                      f"--master-port={port}", str(REPO / "train.py"), *args,
                                      *(node1 if node == 1 else ()), f"run.root={root}"] for node in (0, 1)],
                                    env, timeout=timeout)
    return [(launch.returncode, launch.stderr) for launch in done]


def _the_run_folder(root: Path) -> Path:
    folders = [p for p in (root / "runs").glob("*/*") if p.is_dir()]
    assert len(folders) == 1, f"one run folder for both nodes, found {folders}"
    return folders[0]


def test_two_nodes_train_one_run_and_survive_losing_one_node(local_shards, tmp_path):
    args = [*RUN, f"data.source={local_shards}", *TWO_NODES]
    done = _two_nodes(args, tmp_path / "reference")
    assert [rc for rc, _ in done] == [0, 0], done[0][1][-3000:] + done[1][1][-3000:]
    reference = _the_run_folder(tmp_path / "reference")
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["processes"] == {"count": 2, "strategy": "DDPStrategy", "launched_by": "torchrun"}
    # 4 per process on 2 nodes: a global batch of 8; 36 images dealt to 2 ranks, 4 steps an epoch
    assert summary["hyperparameters"]["global_batch_size"] == 8 and summary["steps"] == 8

    # node 1 lost (SIGKILL to its rank and loader worker) as step 7 ends; last.ckpt is of step 6, two
    # batches into the second epoch; node 0 fails on the broken connection
    lost = _two_nodes([*args, "checkpointing.every_n_steps=2"], tmp_path / "lost",
                      node1=("+callbacks.kill._target_=tests.helpers.KillNodeAt", "+callbacks.kill.step=7"))
    # torchrun starts its rank in a session of its own: the agent outlives it and reports the kill
    assert lost[1][0] != 0 and "Signal 9 (SIGKILL)" in lost[1][1], lost[1][1][-3000:]
    assert lost[0][0] != 0, lost[0][1][-3000:]
    folder = _the_run_folder(tmp_path / "lost")
    position = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu",
                          weights_only=False)["ShardsDataModule"]["stream_position"]
    assert position["taken"] == 2 and position["litdata"]["dataset"]["world_size"] == 2
    resumed = _two_nodes([*args, "checkpointing.every_n_steps=2", "resume=auto"], tmp_path / "lost")
    assert [rc for rc, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    summaries = sorted((tmp_path / "lost").glob("runs/*/*/summary.json"), key=lambda p: p.stat().st_mtime_ns)
    final = json.loads(summaries[-1].read_text())
    assert final["status"] == "completed" and final["resumed_from"]["global_step"] == 6 and final["steps"] == 8
    expected, got = weights(reference / "checkpoints" / "last.ckpt"), weights(Path(final["final_checkpoint"]))
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ from the reference"


def test_trains_from_the_bucket_through_a_size_limited_cache(s3, tmp_path, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "cache"
    result = train_forked([*RUN, "data.source=s3://training-data/photos", f"data.cache_dir={cache}",
                           "data.cache_limit_gb=0.05", "trainer.max_epochs=1", f"run.root={tmp_path}"],
                          tmp_path / "run")
    assert result.returncode == 0, result
    assert result.summary["steps"] == STEPS // 2 and result.summary["data"]["sizes"] == {"train": 36, "val": 12,
                                                                                          "test": 12}
    assert list(cache.rglob("*.bin")), "no chunk was cached"


def test_store_failures_are_one_line_naming_the_source(s3, local_shards, tmp_path, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    source = "data.source=s3://training-data/photos"

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    line = _one_line(train_forked([*RUN, source, f"run.root={tmp_path}"], tmp_path / "creds"),
                     "s3://training-data/photos")
    assert "refused the credentials" in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)

    line = _one_line(train_forked([*RUN, "data.source=s3://no-such-bucket/photos", f"run.root={tmp_path}"],
                                  tmp_path / "bucket"), "s3://no-such-bucket/photos")
    assert "bucket 'no-such-bucket' does not exist" in line

    line = _one_line(train_forked([*RUN, source, "data.endpoint_url=https://127.0.0.1:9", f"run.root={tmp_path}"],
                                  tmp_path / "gone"), "s3://training-data/photos")
    assert "cannot be reached" in line

    damaged = tmp_path / "damaged"
    shutil.copytree(local_shards, damaged)
    chunk = next((damaged / "train").glob("chunk-*.bin"))
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 3])
    line = _one_line(train_forked([*RUN, f"data.source={damaged}", f"run.root={tmp_path}"], tmp_path / "cut"),
                     str(damaged))
    assert "cannot be read" in line or "damaged" in line


def test_a_store_that_goes_away_mid_run_is_retried_then_one_line_and_the_run_exits(tmp_path, monkeypatch):
    # A server of its own (the module's serves the other tests), killed as step 1 ends; the
    # photos are the decode benchmark's, in chunks of 1 MB, so the run still has chunks to fetch.
    from tests import s3_server
    from tests.helpers import benchmark
    from trainer.data.prepare_shards import prepare_shards

    root = benchmark("input_pipeline").make_folder(tmp_path / "photos", 120)
    server = s3_server.start(tmp_path)
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        prepare_shards(root, f"s3://{s3_server.BUCKET}/big", chunk_mb=1, progress=False)
        result = train_forked([*RUN, f"data.source=s3://{s3_server.BUCKET}/big", f"data.cache_dir={tmp_path / 'cache'}",
                               "trainer.max_epochs=1", "+callbacks.stop._target_=tests.helpers.StopProcessAt",
                               "+callbacks.stop.step=1", f"+callbacks.stop.pid={server.process.pid}",
                               f"run.root={tmp_path}"], tmp_path / "run", timeout=240)
    finally:
        server.stop()
    line = _one_line(result, f"s3://{s3_server.BUCKET}/big/", trained=True)
    assert "cannot be reached (after retries)" in line
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
