"""Run a script written for Horovod (and, with HORORING_SHIM_TF1=1, for TF1-era Keras)
against hororing, unchanged: imported by Python at start-up from PYTHONPATH.

- ``horovod``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``, ``horovod.keras`` and
  ``horovod.torch`` are hororing's modules.
- ``keras.datasets.mnist.load_data`` (and ``tf.keras``'s) returns an offline stand-in with
  MNIST's shapes and types: scikit-learn's handwritten digits (8x8, 0-16) scaled to 0-255 and
  enlarged 3x into 24x24 within a 28x28 frame; 1437 training and 360 test images.
- HORORING_SHIM_TF1=1: TensorFlow 1 behaviour (``tf.compat.v1.disable_v2_behavior()``),
  TF1 names on ``tensorflow`` (``ConfigProto``, ``Session``), and ``import keras`` is tf-keras's
  TF1 API (``tf.compat.v1.keras``: sessions, legacy optimizers), as standalone Keras 2 was.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys


def _digits_as_mnist(*args, **kwargs):
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


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import ``prefix.X`` as ``target.X`` (one module object under both names)."""

    def __init__(self, prefix, target, rename=None):
        self.prefix, self.target, self.rename = prefix, target, rename or {}

    def find_spec(self, name, path=None, target=None):
        if name == self.prefix or name.startswith(self.prefix + "."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        tail = spec.name[len(self.prefix):]
        real = self.rename.get(tail, self.target + tail)
        return importlib.import_module(real)

    def exec_module(self, module):
        pass


class _Horovod(_Alias):
    def create_module(self, spec):
        return importlib.import_module("hororing" + spec.name[len("horovod"):])


def _install():
    sys.meta_path.insert(0, _Horovod("horovod", "hororing"))
    tf1 = os.environ.get("HORORING_SHIM_TF1") == "1"
    if tf1:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        import tensorflow as tf
        tf.compat.v1.disable_v2_behavior()
        for name in ("ConfigProto", "Session", "get_default_graph"):
            setattr(tf, name, getattr(tf.compat.v1, name))
        sys.meta_path.insert(0, _Alias("keras", "tf_keras.api._v1.keras"))
    if os.environ.get("HORORING_SHIM_MNIST", "1") == "1":
        _patch_mnist(tf1)


def _patch_mnist(tf1):
    """Replace every mnist loader the script may reach, by module and by attribute."""
    names = ["tf_keras.datasets.mnist", "tf_keras.src.datasets.mnist",
             "tf_keras.api._v1.keras.datasets.mnist"]
    if not tf1:
        names += ["keras.datasets.mnist", "keras.src.datasets.mnist"]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.load_data = _digits_as_mnist


_install()
