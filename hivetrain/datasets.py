"""Datasets for the swarm: scikit-learn's digits, Fashion-MNIST, CIFAR-10 and synthetic CIFAR-10-shaped noise. Free of
Lightning, so that the roles that only evaluate (the coordinator's validator, hivetrain.evaluate, the benchmarks) do
not import it and torchmetrics (seconds of CPU at every start); hivetrain.data wraps them in a LightningDataModule for
training.

Every image reaches the model as a normalised float tensor (3, img_size, img_size) and every label as int64, so
the model never cares which dataset it trains on: made per sample on the CPU, or, with `device_transforms` (peers),
per batch on the training device from the stored pixels (hivetrain.pixels). Everything works offline: digits ship with
scikit-learn, Fashion-MNIST with Debian's `dataset-fashion-mnist`, and CIFAR-10 is read from any folder
in the python-pickle layout without torchvision's md5 checks; the synthetic set is generated
(hivetrain.synthetic_data).
"""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms as T
from torchvision.datasets import CIFAR10, FashionMNIST

from hivetrain.config import RunConfig
from hivetrain.files import atomic_write
from hivetrain.pixels import DATASET_STATS
from hivetrain.synthetic_data import TRAIN_SAMPLES, VAL_SAMPLES, SyntheticCifar10

DEFAULT_DATA_DIR = Path("~/.cache/hivetrain/data").expanduser()
DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")  # `apt-get install dataset-fashion-mnist`
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_LAYOUT = f"<data-dir>/{CIFAR_FOLDER}/{{data_batch_1..5,test_batch,batches.meta}}"

class DatasetUnavailable(RuntimeError):
    """The dataset is neither on disk nor downloadable; the message says where to put it."""


class ImageTensors(Dataset):
    """Images (N, C, H, W) held in memory as uint8 or [0, 1] floats, transformed per sample."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor]):
        assert len(images) == len(labels)
        self.images, self.labels, self.transform = images, labels.to(torch.int64), transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.labels[i]


class TransformedImages(Dataset):
    """Another dataset's (uint8 or [0, 1] image, label) pairs, transformed per sample as ImageTensors does."""

    def __init__(self, images: Dataset, transform: Callable[[torch.Tensor], torch.Tensor]):
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return len(self.images)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.images[i]
        return self.transform(image), label


# module-level functions (not lambdas), so the transforms pickle into DataLoader workers
def _unit_float(x: torch.Tensor) -> torch.Tensor:
    return x.float().div_(255) if x.dtype == torch.uint8 else x


def _to_rgb(x: torch.Tensor) -> torch.Tensor:
    return x.expand(3, -1, -1) if x.shape[0] == 1 else x


def _transform(dataset: str, native: int, img_size: int, augment: bool, on_device: bool = False) -> T.Compose:
    """The per-sample transform of a dataset stored at `native` px. On the CPU alone: scaled to [0, 1], resized to
    `img_size`, augmented, RGB and normalised. With `on_device`, only the augmentation, at the stored size and dtype
    (a crop shifted by up to an eighth of the image and a flip, as at `img_size`); the data module's
    on_after_batch_transfer does the rest on the training device (hivetrain.pixels.to_model_input)."""
    size = native if on_device else img_size
    steps: list[Callable] = [] if on_device else [_unit_float]
    if native != size:
        steps.append(T.Resize((size, size), antialias=True))
    if augment:
        steps.append(T.RandomCrop(size, padding=size // 8))  # pads black, before normalising
        if dataset != "digits":  # a mirrored 2 or 7 is no longer that digit
            steps.append(T.RandomHorizontalFlip())
    if not on_device:
        steps += [_to_rgb, T.Normalize(*DATASET_STATS[dataset])]
    return T.Compose(steps)


Split = tuple[torch.Tensor, torch.Tensor]  # images (N, C, H, W), labels (N,)


def digits_file() -> Path:
    """scikit-learn's bundled digits, found without importing scikit-learn (that costs a joining peer ~1.3 s)."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        raise DatasetUnavailable("the digits dataset ships with scikit-learn, which is not installed here:"
                                 " pip install scikit-learn")
    return path


def load_digits_split(img_size: int) -> tuple[Split, Split]:
    with gzip.open(digits_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",")  # as sklearn's load_digits: a row is 64 pixels in 0..16, then the label
    x = torch.tensor(table[:, :-1].reshape(-1, 1, 8, 8), dtype=torch.float32).div_(16)  # (1797, 1, 8, 8) in [0, 1]
    if img_size != 8:  # upscale the whole set once here instead of per sample
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    y = torch.as_tensor(table[:, -1].astype(np.int64))
    perm = torch.from_numpy(np.random.RandomState(0).permutation(len(x)))  # fixed: every peer gets the same split
    n_val = -(-len(x) // 5)  # 20% rounded up: 360 of 1,797
    val, train = perm[:n_val], perm[n_val:]
    return (x[train], y[train]), (x[val], y[val])


def _unpack_debian_fashion(root: Path) -> None:
    """Decompress Debian's Fashion-MNIST into torchvision's raw layout, unless it is already there."""
    raw = root / "FashionMNIST" / "raw"
    if all((raw / name).is_file() for name in FASHION_FILES):
        return
    if not all((DEBIAN_FASHION_DIR / f"{name}.gz").is_file() for name in FASHION_FILES):
        raise DatasetUnavailable(
            f"Fashion-MNIST not found: expected torchvision's layout <data-dir>/FashionMNIST/raw/"
            f"{{{','.join(FASHION_FILES)}}} under --data-dir {root}, or Debian's gzipped copies in "
            f"{DEBIAN_FASHION_DIR} (`apt-get install dataset-fashion-mnist`), and this machine cannot download."
        )
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_FILES:
        if (raw / name).is_file():
            continue
        with gzip.open(DEBIAN_FASHION_DIR / f"{name}.gz") as src:  # peers sharing a data dir never see half a file
            atomic_write(raw / name, lambda out: shutil.copyfileobj(src, out))


def load_fashion_split(root: Path) -> tuple[Split, Split]:
    _unpack_debian_fashion(root)
    splits = []
    for train in (True, False):
        try:
            ds = FashionMNIST(root, train=train, download=False)  # Debian recompressed the .gz: md5s differ
        except (RuntimeError, OSError, ValueError) as e:
            raise DatasetUnavailable(f"Fashion-MNIST under --data-dir {root}/FashionMNIST/raw is unreadable: {e}") from e
        splits.append((ds.data.unsqueeze(1), ds.targets))  # uint8 (N, 1, 28, 28)
    return splits[0], splits[1]


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        # the CIFAR site's pickles load with str keys; ones written from Python 3 often carry b"data"
        entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
        data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3 * 32 * 32)
        labels = [int(v) for v in entry["labels"]]
        if len(labels) != len(data):
            raise ValueError(f"{len(data)} images but {len(labels)} labels")
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise DatasetUnavailable(
            f"CIFAR-10 batch {path} is missing or unreadable ({type(e).__name__}: {e}); point --data-dir at a folder "
            f"laid out as {CIFAR_LAYOUT} (the python pickle version from the CIFAR site)."
        ) from e
    return data, labels


def load_cifar_split(root: Path) -> tuple[Split, Split]:
    # Read the batches ourselves rather than through torchvision's CIFAR10, which insists on the official md5s
    # (and str keys), so self-written CIFAR-format folders work too.
    splits = []
    for names in (CIFAR_TRAIN_FILES, ("test_batch",)):
        batches = [_read_cifar_batch(root / CIFAR_FOLDER / name) for name in names]
        x = torch.from_numpy(np.concatenate([b[0] for b in batches]).reshape(-1, 3, 32, 32))  # uint8 CHW
        splits.append((x, torch.tensor([y for b in batches for y in b[1]], dtype=torch.int64)))
    return splits[0], splits[1]


def prepare_dataset(config: RunConfig, data_dir: Path) -> None:
    """Download CIFAR-10 into `data_dir` unless it is there (the other datasets need nothing)."""
    if config.data.dataset != "cifar10" or (data_dir / CIFAR_FOLDER).is_dir():
        return
    try:
        CIFAR10(data_dir, train=True, download=True)
    except (OSError, RuntimeError) as e:  # URLError is an OSError: no network
        raise DatasetUnavailable(
            f"CIFAR-10 is not in --data-dir {data_dir} and could not be downloaded "
            f"({type(e).__name__}: {e}). Put the python pickle version from the CIFAR site there, laid out as "
            f"{CIFAR_LAYOUT}, or run once with network access."
        ) from e


def load_splits(config: RunConfig, data_dir: Path, device_transforms: bool = False,
                val_limit: int | None = None) -> tuple[Dataset, Dataset]:
    """The run's training and validation sets.

    Args:
        config: the run; its dataset, image size and augmentation shape the data.
        data_dir: where the dataset's files are (CIFAR-10: downloaded there first when missing).
        device_transforms: give the stored images (uint8 at their own size, augmented there) for the training
            device to scale, resize and normalise (hivetrain.pixels.to_model_input), instead of model inputs.
        val_limit: the first N validation samples only (None: all), so every role evaluates on the same samples.
    """
    dataset, img_size, augment = config.data.dataset, config.model.img_size, config.data.augment
    if dataset == "synthetic":
        # Generated from the run's seed, so every peer and the coordinator hold the same images, and sent through
        # CIFAR-10's own transforms (its statistics, resize and augmentation): the mission's pipeline, no download.
        train_set: Dataset = TransformedImages(SyntheticCifar10(TRAIN_SAMPLES, config.seed, "train"),
                                               _transform("cifar10", 32, img_size, augment, device_transforms))
        val_set: Dataset = TransformedImages(SyntheticCifar10(VAL_SAMPLES, config.seed, "val"),
                                             _transform("cifar10", 32, img_size, False, device_transforms))
    else:
        if dataset == "digits":
            (train, val), native = load_digits_split(img_size), img_size  # already resized
        elif dataset == "fashion-mnist":
            (train, val), native = load_fashion_split(data_dir), 28
        else:
            prepare_dataset(config, data_dir)  # no-op when the folder exists
            (train, val), native = load_cifar_split(data_dir), 32
        train_set = ImageTensors(*train, _transform(dataset, native, img_size, augment, device_transforms))
        val_set = ImageTensors(*val, _transform(dataset, native, img_size, False, device_transforms))
    if val_limit is not None:
        val_set = Subset(val_set, range(min(val_limit, len(val_set))))  # type: ignore[arg-type]
    return train_set, val_set


def data_root(data_dir: str | Path | None) -> Path:
    """`--data-dir` as a path: DEFAULT_DATA_DIR when None."""
    return Path(data_dir).expanduser() if data_dir is not None else DEFAULT_DATA_DIR


def validation_loader(config: RunConfig, data_dir: str | Path | None = None, batch_size: int | None = None,
                      val_limit: int | None = None) -> DataLoader:
    """The run's validation split in order, as model inputs, for a role that evaluates (hivetrain.evaluate).

    Args:
        config: the run.
        data_dir: where the dataset's files are (None: DEFAULT_DATA_DIR).
        batch_size: samples per batch (None: the run's).
        val_limit: the first N validation samples only (None: all).
    """
    _, val_set = load_splits(config, data_root(data_dir), val_limit=val_limit)
    return DataLoader(val_set, batch_size=batch_size or config.batch_size, shuffle=False)
