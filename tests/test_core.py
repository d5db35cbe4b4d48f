"""Run config, model factory and the strategy inside one Lightning Trainer."""

import dataclasses
import json
import time

import lightning.pytorch as pl
import pytest
import timm
import torch
from s3server import free_ports

from hivetrain.config import PRESETS, RunConfig, get_preset
from hivetrain.data import make_datamodule
from hivetrain.model import PretrainedWeightsUnavailable, create_model
from hivetrain.module import ImageClassifier
from hivetrain.optimizer import warmup_cosine
from hivetrain.strategy import HivemindStrategy
from hivetrain.swarm_options import HivemindOptions
from hivetrain.swarm import DHTOptions


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trip_and_fingerprint(name):
    config = get_preset(name)
    again = RunConfig.from_json(config.to_json())
    assert again == config and again.fingerprint == config.fingerprint
    assert config.replace(seed=config.seed + 1).fingerprint != config.fingerprint


def test_config_rejects_bad_values():
    config = get_preset("demo")
    with pytest.raises(ValueError, match="run_id"):
        config.replace(run_id="a.b")
    with pytest.raises(ValueError, match="precision"):
        config.replace(precision="fp8")
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")
    with pytest.raises(ValueError, match="not a valid RunConfig"):
        RunConfig.from_json('{"run_id": "x"}')
    swarm = config.swarm
    with pytest.raises(ValueError, match="robust aggregation 'median'"):
        config.replace(swarm=dataclasses.replace(swarm, robust_aggregation="median"))
    with pytest.raises(ValueError, match="clip_radius"):
        config.replace(swarm=dataclasses.replace(swarm, robust_aggregation="centered-clip", clip_radius=0.0))
    with pytest.raises(ValueError, match="trim_fraction"):
        config.replace(swarm=dataclasses.replace(swarm, robust_aggregation="trimmed-mean", trim_fraction=0.5))
    for seconds in (0.5, float("nan"), float("inf"), 86_401.0):  # a run record from the DHT may say anything
        with pytest.raises(ValueError, match="round_seconds"):
            config.replace(swarm=dataclasses.replace(swarm, round_seconds=seconds))
    with pytest.raises(ValueError, match="not a valid RunConfig"):
        RunConfig.from_dict({**config.to_dict(), "swarm": {**config.to_dict()["swarm"], "round_seconds": "soon"}})


def test_robust_aggregation_is_part_of_the_fingerprint():
    config = get_preset("demo")
    assert config.swarm.robust_aggregation == "none"
    clipped = config.replace(swarm=dataclasses.replace(config.swarm, robust_aggregation="centered-clip"))
    wider = config.replace(swarm=dataclasses.replace(clipped.swarm, clip_radius=2.0))
    trimmed = config.replace(swarm=dataclasses.replace(config.swarm, robust_aggregation="trimmed-mean"))
    fingerprints = {c.fingerprint for c in (config, clipped, wider, trimmed)}
    assert len(fingerprints) == 4  # peers that would combine parts differently never share a run
    assert RunConfig.from_json(wider.to_json()) == wider


def test_a_record_from_before_a_setting_existed_keeps_its_meaning_and_fingerprint():
    # CenteredClip's radius was 1 before its default became 0.25: a run recorded then (its manifest has no
    # clip_radius) loads with 1 and keeps the fingerprint its checkpoints and records carry
    config = get_preset("demo")
    old = config.replace(swarm=dataclasses.replace(config.swarm, clip_radius=1.0))
    assert "clip_radius" not in json.loads(old.to_json())["swarm"]
    loaded = RunConfig.from_json(old.to_json())
    assert loaded.swarm.clip_radius == 1.0 and loaded == old and loaded.fingerprint == old.fingerprint
    assert config.swarm.clip_radius == 0.25 and config.fingerprint != old.fingerprint


def test_a_peers_options_carry_every_swarm_setting_of_the_run():
    """HivemindOptions.for_run: each SwarmConfig setting reaches the peer's options by name, none copied by hand."""
    swarm = dataclasses.replace(get_preset("demo").swarm, mode="diloco", inner_steps=7, outer_lr=0.5,
                                robust_aggregation="trimmed-mean", target_group_size=3, overlap_rounds=True)
    options = HivemindOptions.for_run("run", swarm, batch_size=16, verbose=True)
    for field in dataclasses.fields(swarm):
        assert getattr(options, field.name) == getattr(swarm, field.name), field.name
    assert (options.run_id, options.batch_size, options.verbose) == ("run", 16, True)


def test_warmup_cosine():
    schedule = [warmup_cosine(step, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for step in range(25)]
    assert schedule[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(schedule[3:], schedule[4:]))
    assert schedule[20] == pytest.approx(0.1) and schedule[24] == pytest.approx(0.1)


def test_pretrained_offline_fails_fast():
    started = time.monotonic()
    with pytest.raises(PretrainedWeightsUnavailable, match="--pretrained-weights FILE"):
        create_model(get_preset("cifar10-vit-b32").model)
    assert time.monotonic() - started < 10


def test_pretrained_unreachable_hub_fails_fast(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (port,) = free_ports(1)  # a hub address where nothing listens, on loopback
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(PretrainedWeightsUnavailable, match="--pretrained-weights FILE"):
        create_model(get_preset("cifar10-vit-b32").model)
    assert time.monotonic() - started < 10



def test_pretrained_weights_from_file(tmp_path):
    source = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=16, num_classes=1000)
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    config = get_preset("demo").model
    pretrained = type(config)(name="vit_tiny_patch16_224", img_size=32, num_classes=10, pretrained=True,
                              kwargs=dict(patch_size=16))
    model = create_model(pretrained, path)
    for name, param in model.state_dict().items():
        if not name.startswith("head."):  # the 10-class head is new; everything else is the file's, bit for bit
            assert torch.equal(param, source.state_dict()[name]), name
    assert model.head.out_features == 10
    with pytest.raises(PretrainedWeightsUnavailable, match="no such file"):
        create_model(pretrained, tmp_path / "missing.pth")


class _SwarmState(pl.Callback):
    """What the swarm's optimizer holds when training ends (teardown then shuts it down)."""

    def on_train_end(self, trainer, pl_module):
        self.epoch = trainer.strategy.local_epoch
        self.lrs = [group["lr"] for group in trainer.strategy.optimizer.opt.param_groups]


def test_strategy_steps_schedule_on_swarm_epochs_in_bf16():
    """One peer alone: every 2 local steps of b samples make a swarm epoch of 2b; the LR follows swarm epochs."""
    torch.set_num_threads(1)
    config = get_preset("demo")
    b = 16
    strategy = HivemindStrategy(
        HivemindOptions(run_id="test_bf16", target_batch_size=2 * b, batch_size=b, matchmaking_time=0.5),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    module = ImageClassifier(config, create_model(config.model, seed=config.seed))
    state = _SwarmState()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=6,
                         max_epochs=-1, limit_val_batches=0, enable_checkpointing=False, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[state])
    trainer.fit(module, datamodule=make_datamodule(config, batch_size=b, seed=1))
    assert state.epoch == 3
    optim = config.optim
    expected = optim.lr * warmup_cosine(state.epoch, optim.warmup_steps, optim.total_steps, optim.min_lr_ratio)
    assert state.lrs == pytest.approx([expected, expected])
    assert strategy.optimizer is None  # teardown shut the swarm's optimizer down
