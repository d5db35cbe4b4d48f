"""The synthetic-vit-b32 preset: the mission's run on seeded CIFAR-10-shaped noise, trainable with nothing to
download. Its data's shape and determinism, its settings against the mission's, and one real Lightning training step
of the project's module on its data at a reduced size on CPU."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

from hivetrain.roles.coordinator.options import parse_args as coordinator_args
from hivetrain.config import DATASETS, RunConfig, get_preset
from hivetrain.data import make_datamodule
from hivetrain.pixels import DATASET_STATS
from hivetrain.model import create_model
from hivetrain.module import ImageClassifier
from hivetrain.synthetic_data import TRAIN_SAMPLES, VAL_SAMPLES
from hivetrain.roles.peers.join import parse_args as peer_args

MISSION = get_preset("cifar10-vit-b32")
SYNTHETIC = get_preset("synthetic-vit-b32")


def small(config: RunConfig, img_size: int = 32) -> RunConfig:
    """The preset with a one-block ViT at `img_size` and batch 4: a CPU trains a step of it in a second."""
    model = dataclasses.replace(config.model, img_size=img_size, kwargs=dict(embed_dim=32, depth=1, num_heads=2))
    return config.replace(model=model, batch_size=4)


def test_preset_is_the_mission_on_synthetic_data_from_random_weights():
    assert "synthetic" in DATASETS
    assert SYNTHETIC.data.dataset == "synthetic" and SYNTHETIC.data.augment == MISSION.data.augment
    assert SYNTHETIC.model.name == "vit_base_patch32_224" and SYNTHETIC.model.img_size == 224
    assert not SYNTHETIC.model.pretrained and MISSION.model.pretrained
    assert SYNTHETIC.model.kwargs == MISSION.model.kwargs and SYNTHETIC.model.num_classes == 10
    assert SYNTHETIC.optim == MISSION.optim and SYNTHETIC.swarm == MISSION.swarm
    assert SYNTHETIC.swarm.mode == "diloco" and SYNTHETIC.batch_size == MISSION.batch_size
    assert (SYNTHETIC.precision, SYNTHETIC.seed) == (MISSION.precision, MISSION.seed)
    assert SYNTHETIC.fingerprint != MISSION.fingerprint and RunConfig.from_json(SYNTHETIC.to_json()) == SYNTHETIC
    # the roles take it by name
    assert coordinator_args(["--preset", "synthetic-vit-b32"]).preset == "synthetic-vit-b32"
    assert peer_args(["--preset", "synthetic-vit-b32"]).preset == "synthetic-vit-b32"


def test_data_is_cifar_shaped_resized_to_224_and_normalised_like_cifar10():
    dm = make_datamodule(SYNTHETIC, val_limit=8)
    dm.setup()
    assert (dm.num_train, dm.num_val) == (TRAIN_SAMPLES, 8)
    raw_image, raw_label = dm.train_set.images[0]  # the generated sample before CIFAR-10's transforms
    assert raw_image.shape == (3, 32, 32) and raw_image.dtype == torch.uint8
    assert raw_label.dtype == torch.int64 and 0 <= int(raw_label) < 10
    image, label = dm.val_set[0]
    assert image.shape == (3, 224, 224) and image.dtype == torch.float32 and int(label) == int(dm.val_set[0][1])
    # CIFAR-10's normalisation: a white pixel is (1 - mean) / std in every channel
    mean, std = DATASET_STATS["cifar10"]
    expected_max = max((1 - m) / s for m, s in zip(mean, std))
    assert float(image.max()) <= expected_max + 1e-4 and float(image.max()) > expected_max - 0.5
    labels = {int(dm.val_set.dataset.images[i][1]) for i in range(200)}
    assert labels == set(range(10))
    full = make_datamodule(SYNTHETIC)
    full.setup()
    assert full.num_val == VAL_SAMPLES


def test_data_depends_on_the_run_seed_only():
    config = small(SYNTHETIC)
    first, again = make_datamodule(config, seed=5), make_datamodule(config, seed=5)
    images, labels = next(iter(first.train_dataloader()))
    images_again, labels_again = next(iter(again.train_dataloader()))
    assert images.shape == (4, 3, 32, 32)
    assert torch.equal(labels, labels_again)
    # augmentation (random crop and flip) draws from torch's global generator: compare the images without it
    plain = config.replace(data=dataclasses.replace(config.data, augment=False))
    a, b = make_datamodule(plain), make_datamodule(plain)
    a.setup()
    b.setup()
    assert torch.equal(a.train_set[123][0], b.train_set[123][0]) and torch.equal(a.val_set[7][0], b.val_set[7][0])
    other = make_datamodule(plain.replace(seed=1))
    other.setup()
    assert not torch.equal(a.train_set[123][0], other.train_set[123][0])
    assert not torch.equal(a.train_set[123][0], a.val_set[123][0])  # the two splits never share an image


def test_one_training_step_of_the_module_on_synthetic_data_on_cpu():
    config = small(SYNTHETIC)
    model = create_model(config.model, seed=config.seed)
    before = [p.detach().clone() for p in model.parameters()]
    module = ImageClassifier(config, model)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, datamodule=make_datamodule(config, seed=0))
    assert trainer.global_step == 1
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_given_weights_start_a_run_that_is_not_pretrained(tmp_path):
    config = small(SYNTHETIC)
    source = create_model(config.model, seed=123)
    path = tmp_path / "weights.pt"
    torch.save(source.state_dict(), path)
    loaded = create_model(config.model, path, seed=0)
    # as for the mission's hub weights, timm keeps the body and re-initialises the classifier head (seeded)
    for (name, want), got in zip(source.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(want, got) != (name == "head.weight"), name  # (the bias starts at zeros either way)
    random_start = create_model(config.model, seed=0)
    assert not torch.equal(random_start.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    with pytest.raises(Exception, match="no such file"):
        create_model(config.model, tmp_path / "missing.pt")
