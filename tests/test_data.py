"""The data module: splits, shapes, per-peer shuffling and clear errors when a dataset is missing."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torch
import torchvision

from hivetrain import datasets
from hivetrain.config import DataConfig, get_preset
from hivetrain.data import make_datamodule
from hivetrain.datasets import DatasetUnavailable

DEMO = get_preset("demo")


def _first_batch(dm) -> tuple[torch.Tensor, torch.Tensor]:
    return next(iter(dm.train_dataloader()))


# --- digits ---------------------------------------------------------------------------------------------


def test_digits_sizes_and_shapes():
    dm = make_datamodule(DEMO)
    dm.setup()
    assert (dm.num_train, dm.num_val) == (1437, 360)
    x, y = _first_batch(dm)
    assert x.shape == (DEMO.batch_size, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) <= 9
    xv, yv = next(iter(dm.val_dataloader()))
    assert xv.shape == (DEMO.batch_size, 3, 32, 32) and yv.dtype == torch.int64


def test_digits_read_directly_equal_sklearns():
    from sklearn.datasets import load_digits

    digits = load_digits()
    (x_train, y_train), (x_val, y_val) = datasets.load_digits_split(8)
    perm = np.random.RandomState(0).permutation(len(digits.target))
    expected = torch.tensor(digits.images, dtype=torch.float32).div(16).unsqueeze(1)[perm]
    assert torch.equal(torch.cat([x_val, x_train]), expected)
    assert torch.equal(torch.cat([y_val, y_train]), torch.as_tensor(digits.target)[perm])


def test_digits_without_sklearn_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetUnavailable, match="pip install scikit-learn"):
        datasets.load_digits_split(8)


def test_digits_split_is_deterministic():
    a, b = make_datamodule(DEMO, seed=1), make_datamodule(DEMO, seed=2)
    a.setup(), b.setup()
    va = torch.cat([y for _, y in a.val_dataloader()])
    vb = torch.cat([y for _, y in b.val_dataloader()])
    assert torch.equal(va, vb)
    assert torch.equal(a.val_set[0][0], b.val_set[0][0])


def test_digits_seed_controls_order():
    same = [_first_batch(make_datamodule(DEMO, seed=7)) for _ in range(2)]
    other = _first_batch(make_datamodule(DEMO, seed=8))
    assert torch.equal(same[0][0], same[1][0]) and torch.equal(same[0][1], same[1][1])
    assert not torch.equal(same[0][0], other[0])


def test_digits_drop_last_and_val_limit():
    dm = make_datamodule(DEMO, batch_size=100, val_limit=50)
    dm.setup()
    batches = [len(y) for _, y in dm.train_dataloader()]
    assert batches == [100] * (1437 // 100)  # the 37 left over are dropped
    assert dm.num_val == 50 and sum(len(y) for _, y in dm.val_dataloader()) == 50
    full = make_datamodule(DEMO)
    full.setup()
    assert torch.equal(dm.val_set[49][0], full.val_set[49][0])  # the first 50, not a random 50


def test_digits_normalised():
    dm = make_datamodule(DEMO, batch_size=512)
    x = torch.cat([x for x, _ in dm.train_dataloader()])
    assert x.mean(dim=(0, 2, 3)).abs().max() < 0.2


def test_digits_augment_keeps_shape():
    config = DEMO.replace(data=DataConfig("digits", augment=True))
    dm = make_datamodule(config)
    x, _ = _first_batch(dm)
    assert x.shape == (DEMO.batch_size, 3, 32, 32)
    assert not any(isinstance(t, torchvision.transforms.RandomHorizontalFlip) for t in dm.train_set.transform.transforms)


# --- cifar10 --------------------------------------------------------------------------------------------

CIFAR = DEMO.replace(data=DataConfig("cifar10"), model=dataclasses.replace(DEMO.model, img_size=32))


def _write_cifar(root: Path, per_batch: int = 4, str_keys: bool = False) -> Path:
    folder = root / datasets.CIFAR_FOLDER
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    key = (lambda k: k) if str_keys else (lambda k: k.encode())
    for i, name in enumerate([*datasets.CIFAR_TRAIN_FILES, "test_batch"]):
        batch = {key("data"): rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 key("labels"): [(i + j) % 10 for j in range(per_batch)], key("batch_label"): name}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({key("label_names"): [f"c{i}" for i in range(10)]}))
    return folder


@pytest.fixture
def no_download(monkeypatch):
    def fail(self):
        raise URLError("no network in tests")

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", fail)


@pytest.mark.parametrize("str_keys", [False, True])
def test_cifar_folder_loads(tmp_path, no_download, str_keys):
    _write_cifar(tmp_path, str_keys=str_keys)
    dm = make_datamodule(CIFAR, data_dir=tmp_path, batch_size=4)
    dm.prepare_data()
    dm.setup()
    assert (dm.num_train, dm.num_val) == (20, 4)
    x, y = _first_batch(dm)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    labels = torch.cat([y for _, y in dm.val_dataloader()])
    assert labels.tolist() == [5, 6, 7, 8]  # test_batch is the 6th file written: (5 + j) % 10


def test_cifar_resizes(tmp_path, no_download):
    _write_cifar(tmp_path)
    config = CIFAR.replace(model=dataclasses.replace(CIFAR.model, img_size=48), data=DataConfig("cifar10", augment=True))
    x, _ = _first_batch(make_datamodule(config, data_dir=tmp_path, batch_size=4))
    assert x.shape == (4, 3, 48, 48)


@pytest.mark.parametrize("dataset", ["cifar10", "digits"])
def test_device_transforms_give_the_model_the_same_inputs(tmp_path, no_download, dataset):
    """With device_transforms the loaders give the stored pixels (CIFAR-10's uint8 at 32 px) and the data module turns
    each batch into the model's input where Lightning moved it: the same inputs the per-sample CPU pipeline makes."""
    _write_cifar(tmp_path)
    base = CIFAR if dataset == "cifar10" else DEMO
    config = base.replace(model=dataclasses.replace(base.model, img_size=48))
    on_cpu = make_datamodule(config, data_dir=tmp_path, batch_size=4)
    on_device = make_datamodule(config, data_dir=tmp_path, batch_size=4, device_transforms=True)
    expected, labels = next(iter(on_cpu.val_dataloader()))
    stored, same_labels = next(iter(on_device.val_dataloader()))
    if dataset == "cifar10":
        assert stored.dtype == torch.uint8 and stored.shape == (4, 3, 32, 32)  # a sixth of the bytes to pin and move
    x, y = on_device.on_after_batch_transfer((stored, same_labels), 0)
    assert torch.equal(y, labels) and x.shape == expected.shape == (4, 3, 48, 48)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
    assert on_cpu.on_after_batch_transfer((expected, labels), 0)[0] is expected  # without: batches pass as they are
    # augmented at the stored size: a shifted crop and a flip of the 32 px image, then the same resize
    augmented = make_datamodule(config.replace(data=DataConfig(dataset, augment=True)), data_dir=tmp_path,
                                batch_size=4, device_transforms=True)
    stored_train, _ = next(iter(augmented.train_dataloader()))
    assert stored_train.shape == stored.shape and stored_train.dtype == stored.dtype


def test_cifar_missing_without_network(tmp_path, no_download):
    dm = make_datamodule(CIFAR, data_dir=tmp_path / "nothing")
    with pytest.raises(DatasetUnavailable, match="--data-dir") as err:
        dm.prepare_data()
    assert "cifar-10-batches-py" in str(err.value)
    with pytest.raises(DatasetUnavailable):
        dm.setup()


def test_cifar_truncated_batch(tmp_path, no_download):
    folder = _write_cifar(tmp_path)
    path = folder / "data_batch_3"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DatasetUnavailable, match="data_batch_3"):
        make_datamodule(CIFAR, data_dir=tmp_path).setup()


def test_cifar_missing_batch(tmp_path, no_download):
    folder = _write_cifar(tmp_path)
    (folder / "test_batch").unlink()
    with pytest.raises(DatasetUnavailable, match="test_batch"):
        make_datamodule(CIFAR, data_dir=tmp_path).setup()


# --- fashion-mnist --------------------------------------------------------------------------------------

FASHION = DEMO.replace(data=DataConfig("fashion-mnist"))


def test_fashion_from_debian_package(tmp_path):
    if not all((datasets.DEBIAN_FASHION_DIR / f"{n}.gz").is_file() for n in datasets.FASHION_FILES):
        pytest.fail(f"Fashion-MNIST is not in {datasets.DEBIAN_FASHION_DIR}: run `apt-get install dataset-fashion-mnist`")
    dm = make_datamodule(FASHION, data_dir=tmp_path, batch_size=8)
    dm.setup()
    assert (dm.num_train, dm.num_val) == (60000, 10000)
    assert sorted(p.name for p in (tmp_path / "FashionMNIST" / "raw").iterdir()) == sorted(datasets.FASHION_FILES)
    x, y = _first_batch(dm)
    assert x.shape == (8, 3, 32, 32) and y.dtype == torch.int64
    assert torch.equal(x[:, 0], x[:, 1])  # grayscale replicated
    again = make_datamodule(FASHION, data_dir=tmp_path)  # second time: reads the unpacked files
    again.setup()
    assert again.num_train == 60000


def test_fashion_missing_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_DIR", tmp_path / "no-debian")
    with pytest.raises(DatasetUnavailable, match="--data-dir") as err:
        make_datamodule(FASHION, data_dir=tmp_path / "empty").setup()
    assert "apt-get install dataset-fashion-mnist" in str(err.value)
    assert "FashionMNIST/raw" in str(err.value)
