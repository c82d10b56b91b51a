"""MNIST for tutorials and tests: local IDX files when given, a synthetic stand-in otherwise.

Nothing is downloaded. The synthetic set has MNIST's shapes and dtypes and a
learnable structure (each class is a fixed random template plus noise), so
losses go down as they would on the real data.
"""
import gzip
import os
import struct

import numpy as np
import torch

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> torch.Tensor:
    """Return the array stored in an IDX file (optionally gzipped) as a tensor."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic {raw[:4]!r}); expected e.g. train-images-idx3-ubyte")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=_IDX_DTYPES[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} ({int(np.prod(dims))} items) but holds {data.size}")
    return torch.from_numpy(data.reshape(dims).astype(np.float32 if raw[2] >= 0x0D else data.dtype))


def mnist(data_dir: str, train: bool = True):
    """Return (images float32 N×1×28×28 normalized, labels int64) from MNIST IDX files in `data_dir`."""
    prefix = "train" if train else "t10k"
    paths = {}
    for kind, stem in (("images", f"{prefix}-images-idx3-ubyte"), ("labels", f"{prefix}-labels-idx1-ubyte")):
        found = [p for p in (stem, stem + ".gz") if os.path.exists(os.path.join(data_dir, p))]
        if not found:
            raise FileNotFoundError(f"no {stem}[.gz] in {data_dir!r}")
        paths[kind] = os.path.join(data_dir, found[0])
    images = read_idx(paths["images"]).float().div_(255).sub_(0.1307).div_(0.3081).unsqueeze(1)
    return images, read_idx(paths["labels"]).long()


def synthetic_mnist(n: int = 1024, seed: int = 0, image_size: int = 28):
    """Return (images N×1×S×S, labels N) of a deterministic, learnable MNIST stand-in."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 1, image_size, image_size, generator=torch.Generator().manual_seed(1234))
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + 0.8 * torch.randn(n, 1, image_size, image_size, generator=g)
    return images, labels


def batches(images, labels, batch_size: int):
    """Yield (images, labels) mini-batches of exactly `batch_size` (the ragged tail is dropped)."""
    for i in range(0, len(images) - batch_size + 1, batch_size):
        yield images[i : i + batch_size], labels[i : i + batch_size]
