"""MNIST's offline stand-in for Horovod's example scripts (nothing here can be downloaded):
scikit-learn's handwritten digits (8x8, 0-16) scaled to 0-255 and enlarged 3x into 24x24
within a 28x28 frame, in MNIST's shapes and types; 1437 training and 360 test images.

    python scripts/horovod_shim/mnist_standin.py DIR   # torchvision's MNIST files in DIR

writes DIR/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte, which
``torchvision.datasets.MNIST(DIR, download=True)`` finds and does not download
(examples/pytorch/pytorch_mnist.py --data-dir DIR). sitecustomize.py gives Keras the same
images through ``mnist.load_data``.
"""

import pathlib
import struct
import sys


def digits_as_mnist(*args, **kwargs):
    """((train images, labels), (test images, labels)), as ``mnist.load_data()`` returns."""
    import numpy as np
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = np.zeros((len(digits.images), 28, 28), np.uint8)
    scaled = np.kron(digits.images / 16.0 * 255.0, np.ones((3, 3))).round().astype(np.uint8)
    images[:, 2:26, 2:26] = scaled
    labels = digits.target.astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    split = len(labels) * 4 // 5
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def write_torchvision_mnist(root):
    """MNIST's idx files (uncompressed) under ``root``/MNIST/raw."""
    raw = pathlib.Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (train_x, train_y), (test_x, test_y) = digits_as_mnist()
    for prefix, images, labels in (("train", train_x, train_y), ("t10k", test_x, test_y)):
        # idx: magic (0x0803 images, 0x0801 labels), the dimensions, big-endian, then the bytes
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">4I", 0x803, len(images), 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">2I", 0x801, len(labels)) + labels.tobytes())
    return raw


if __name__ == "__main__":
    print(write_torchvision_mnist(sys.argv[1]))
