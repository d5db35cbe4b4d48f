"""Checkpoints: the self-verifying bundle, the local store, the S3 store against a real S3 server (SeaweedFS on
loopback), and `python -m hivetrain.evaluate` on what they saved."""

import json
import logging
import math
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import torch
from conftest import BUCKET
from s3server import SeaweedS3, free_ports

from hivetrain.checkpoint import Checkpoint, CheckpointCorrupted, CheckpointError, LocalCheckpointStore, read_checkpoint
from hivetrain.checkpoint_location import load_checkpoint
from hivetrain.config import RunConfig, get_preset
from hivetrain.data import make_datamodule
from hivetrain.evaluate import evaluate
from hivetrain.evaluate import main as evaluate_main
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.s3_store import MiB, S3CheckpointStore, S3Options

ROOT = Path(__file__).resolve().parent.parent




@dataclass
class Demo:
    config: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    fresh: dict  # metrics of the freshly initialised model
    metrics: dict  # metrics after the perturbation

    def checkpoint(self, epoch: int, with_optimizer: bool = True, **metrics) -> Checkpoint:
        return Checkpoint.from_model(self.model, self.config, epoch, {**self.metrics, **metrics},
                                     self.optimizer if with_optimizer else None,
                                     self.scheduler if with_optimizer else None)


@pytest.fixture(scope="module")
def demo() -> Demo:
    """The demo model, moved off its seeded initialisation by one AdamW step on seeded random gradients: a reload
    that silently rebuilt the model from its seed instead of the checkpoint would show a different loss."""
    config = get_preset("demo")
    model = create_model(config.model, seed=config.seed)
    loader = make_datamodule(config).val_dataloader()
    fresh = evaluate(model, loader)
    optimizer, scheduler = make_optimizer(model, config.optim)
    generator = torch.Generator().manual_seed(1234)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return Demo(config, model, optimizer, scheduler, fresh, evaluate(model, loader))


def assert_same_weights(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    state = model.state_dict()
    assert checkpoint.weights.keys() == state.keys()
    assert all(torch.equal(checkpoint.weights[k], state[k]) for k in state)


def run_evaluate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hivetrain.evaluate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, HF_HUB_OFFLINE="1"))


# --- the bundle and the local store


def test_local_store_keeps_last_k_and_the_best(tmp_path, demo, monkeypatch):
    root = tmp_path / "ckpts"
    store = LocalCheckpointStore(root, keep_last=2)
    uris = {epoch: store.save(demo.checkpoint(epoch, with_optimizer=False, top1=epoch / 10), best=epoch == 2)
            for epoch in range(1, 6)}
    files = lambda: sorted(p.name for p in root.iterdir())  # noqa: E731 (hidden temp files would show up too)
    assert files() == ["best.json", "ckpt-000002.tar", "ckpt-000004.tar", "ckpt-000005.tar"]
    assert [(e.epoch, e.top1, e.is_best) for e in store.list()] == [(2, 0.2, True), (4, 0.4, False), (5, 0.5, False)]
    assert store.best_uri() == uris[2]
    assert store.load().epoch == 2 and load_checkpoint(root).epoch == 2  # a folder means its best

    uris[5] = store.save(demo.checkpoint(5, with_optimizer=False, top1=0.5), best=True)  # epoch 2 is neither best
    assert files() == ["best.json", "ckpt-000004.tar", "ckpt-000005.tar"]                 # nor among the last 2 now
    assert [(e.epoch, e.is_best) for e in store.list()] == [(4, False), (5, True)]

    # A save that dies half-way (here while writing the optimizer state) changes nothing and leaves no debris.
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.save(demo.checkpoint(6, top1=0.9), best=True)
    monkeypatch.undo()
    assert files() == ["best.json", "ckpt-000004.tar", "ckpt-000005.tar"]
    best = store.load()
    assert best.epoch == 5 and best.metrics["top1"] == 0.5
    assert_same_weights(best, demo.model)


def test_truncated_and_corrupted_checkpoints_are_refused(tmp_path, demo, capsys):
    path = Path(LocalCheckpointStore(tmp_path / "ckpts").save(demo.checkpoint(3)))
    good = read_checkpoint(path)
    assert_same_weights(good, demo.model)
    assert good.scheduler == demo.scheduler.state_dict()
    assert good.optimizer["param_groups"] == demo.optimizer.state_dict()["param_groups"]

    data = path.read_bytes()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(data[: len(data) // 2])
    with tarfile.open(path) as tar:
        weights = tar.getmember("weights.safetensors")
    flipped = tmp_path / "flipped.tar"
    corrupt = bytearray(data)
    corrupt[weights.offset_data + weights.size // 2] ^= 0xFF  # one byte in the middle of a weight tensor
    flipped.write_bytes(bytes(corrupt))

    with pytest.raises(CheckpointCorrupted, match="truncated.tar .*corrupted"):
        read_checkpoint(truncated)
    with pytest.raises(CheckpointCorrupted, match="weights.safetensors does not match its sha256"):
        read_checkpoint(flipped)

    # The CLI: one line on stderr, a non-zero exit, no traceback. The real entry point once, in-process otherwise.
    result = run_evaluate_cli("--checkpoint", str(flipped))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint {flipped} is corrupted: weights.safetensors does not match its sha256 in the manifest"]
    for bad, message in [(truncated, "corrupted"), (tmp_path / "missing.tar", "does not exist")]:
        assert evaluate_main(["--checkpoint", str(bad)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: checkpoint {bad} ") and message in err[0]


# --- the S3 store on a real S3 server


def s3_store(s3: SeaweedS3, tmp_path: Path, prefix: str, keep_last: int | None = 5, **options) -> S3CheckpointStore:
    options.setdefault("staging_dir", tmp_path / f"staging-{prefix}")
    return S3CheckpointStore(BUCKET, prefix, endpoint_url=s3.endpoint_url, keep_last=keep_last,
                             options=S3Options(**options))


def test_s3_round_trip_through_the_evaluate_cli(s3, demo, tmp_path):
    with s3_store(s3, tmp_path, "roundtrip", multipart_threshold=MiB, multipart_chunksize=5 * MiB) as store:
        uri = store.save(demo.checkpoint(7), best=True)
        assert uri == f"s3://{BUCKET}/roundtrip/ckpt-000007.tar"
        assert list((tmp_path / "staging-roundtrip").iterdir()) == []  # uploaded: the local copy is gone
        [entry] = store.list()
        assert (entry.uri, entry.epoch, entry.top1, entry.is_best) == (uri, 7, demo.metrics["top1"], True)

    out = tmp_path / "metrics.json"
    result = run_evaluate_cli("--checkpoint", uri, "--s3-endpoint-url", s3.endpoint_url, "--out", str(out))
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert (printed["epoch"], printed["samples"]) == (7, demo.metrics["samples"])
    assert printed["top1"] == demo.metrics["top1"]  # exactly: the same weights on the same samples
    assert printed["loss"] == pytest.approx(demo.metrics["loss"], rel=1e-6)
    assert abs(printed["loss"] - demo.fresh["loss"]) > 1e-3  # the checkpoint's weights, not a re-initialised model

    best = load_checkpoint(f"s3://{BUCKET}/roundtrip", endpoint_url=s3.endpoint_url)  # a prefix means its best
    assert best.epoch == 7 and best.config == demo.config and best.metrics["top1"] == demo.metrics["top1"]
    assert_same_weights(best, demo.model)
    assert best.scheduler == demo.scheduler.state_dict()


def test_s3_multipart_upload_is_used_above_the_threshold(s3, demo, tmp_path):
    client = boto3.client("s3", endpoint_url=s3.endpoint_url)
    with s3_store(s3, tmp_path, "multipart", multipart_threshold=MiB, multipart_chunksize=5 * MiB) as store:
        uri = store.save(demo.checkpoint(1))
    head = client.head_object(Bucket=BUCKET, Key="multipart/ckpt-000001.tar")
    size, parts = head["ContentLength"], math.ceil(head["ContentLength"] / (5 * MiB))
    assert size > 5 * MiB and parts >= 2  # weights + AdamW state of the demo model: about 5.7 MiB
    assert head["ETag"].endswith(f'-{parts}"')  # S3 marks multipart objects with their part count
    attributes = client.get_object_attributes(Bucket=BUCKET, Key="multipart/ckpt-000001.tar",
                                              ObjectAttributes=["ObjectParts"])
    assert attributes["ObjectParts"]["TotalPartsCount"] == parts
    # S3 checked a CRC32 of every part as it arrived (it refuses a part that does not match), and reports them
    assert client.head_object(Bucket=BUCKET, Key="multipart/ckpt-000001.tar", ChecksumMode="ENABLED")["ChecksumCRC32"]
    assert load_checkpoint(uri, endpoint_url=s3.endpoint_url).epoch == 1

    with s3_store(s3, tmp_path, "single") as store:  # the default threshold (64 MiB): one PUT, a plain ETag
        store.save(demo.checkpoint(1))
    head = client.head_object(Bucket=BUCKET, Key="single/ckpt-000001.tar", ChecksumMode="ENABLED")
    assert "-" not in head["ETag"] and head["ChecksumCRC32"]


def test_s3_outage_keeps_the_local_copy_and_uploads_when_back(s3, demo, tmp_path, caplog):
    staging = tmp_path / "staging-outage"
    store = s3_store(s3, tmp_path, "outage", keep_last=2, retry_initial=0.2, retry_max=30.0)
    store.save(demo.checkpoint(1))
    s3.stop()
    try:
        with caplog.at_level(logging.INFO, logger="hivetrain.s3_store"):
            started = time.monotonic()
            uri2 = store.save(demo.checkpoint(2, top1=0.8), best=True)
            uri3 = store.save(demo.checkpoint(3, top1=0.7))
            assert time.monotonic() - started < 15  # short timeouts: an outage does not hang training
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"S3 unreachable, keeping the local copy at {staging / 'ckpt-000002.tar'}, "
                                      f"retrying in the background")
        assert sorted(p.name for p in staging.iterdir()) == ["ckpt-000002.tar", "ckpt-000002.tar.best",
                                                             "ckpt-000003.tar"]
        assert store.load(uri2).epoch == 2  # meanwhile the staged copy is the checkpoint
        assert store.best_uri() == uri2
        assert store.flush(timeout=1.0) is False
    finally:
        s3.start()  # same folder, same ports
    assert store.flush(timeout=20) is True
    assert list(staging.iterdir()) == []
    # keep_last=2 pruned epoch 1 once epoch 3 arrived; epoch 2 is the best
    assert [(e.epoch, e.top1, e.is_best) for e in store.list()] == [(2, 0.8, True), (3, 0.7, False)]
    store.close()
    again = load_checkpoint(uri2, endpoint_url=s3.endpoint_url)
    assert again.epoch == 2
    assert_same_weights(again, demo.model)
    assert load_checkpoint(uri3, endpoint_url=s3.endpoint_url).metrics["top1"] == 0.7


def test_s3_staged_copies_upload_when_a_store_opens_again(s3, demo, tmp_path):
    staging = tmp_path / "staging"
    [closed_port] = free_ports(1)  # nothing listens there: S3 "down" without touching the shared server
    down = S3CheckpointStore(BUCKET, "leftover", endpoint_url=f"http://127.0.0.1:{closed_port}",
                             options=S3Options(staging_dir=staging, retry_initial=30))
    uri = down.save(demo.checkpoint(4), best=True)
    down.close()  # the process exits during the outage: the staged copy and its best marker stay
    assert sorted(p.name for p in staging.iterdir()) == ["ckpt-000004.tar", "ckpt-000004.tar.best"]

    with S3CheckpointStore(BUCKET, "leftover", endpoint_url=s3.endpoint_url,
                           options=S3Options(staging_dir=staging)) as store:
        assert store.flush(timeout=30) is True
        assert store.best_uri() == uri
    assert list(staging.iterdir()) == []


def test_s3_refused_upload_raises_and_keeps_the_local_copy(s3, demo, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")  # a 403 is a configuration error, not an outage
    with s3_store(s3, tmp_path, "refused") as store:
        with pytest.raises(CheckpointError, match="SignatureDoesNotMatch") as refused:
            store.save(demo.checkpoint(1))
    assert "wrong-secret" not in str(refused.value)
    assert str(tmp_path / "staging-refused" / "ckpt-000001.tar") in str(refused.value)
    assert (tmp_path / "staging-refused" / "ckpt-000001.tar").is_file()


def test_s3_truncated_object_is_refused(s3, demo, tmp_path):
    with s3_store(s3, tmp_path, "truncated") as store:
        uri = store.save(demo.checkpoint(2))
    client = boto3.client("s3", endpoint_url=s3.endpoint_url)
    key = "truncated/ckpt-000002.tar"
    original = client.get_object(Bucket=BUCKET, Key=key)
    data = original["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=data[: len(data) // 2], Metadata=original["Metadata"])
    with pytest.raises(CheckpointCorrupted, match=f"checkpoint {uri} is truncated or corrupted"):
        load_checkpoint(uri, endpoint_url=s3.endpoint_url)
