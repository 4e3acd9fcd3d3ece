"""Run a script written for Horovod (and, with HORORING_SHIM_TF1=1, for TF1-era Keras)
against hororing, unchanged: imported by Python at start-up from PYTHONPATH.

- ``horovod``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``, ``horovod.keras`` and
  ``horovod.torch`` are hororing's modules: hororing's own alias (hororing/alias.py, what
  ``HORORING_AS_HOROVOD=1`` turns on), installed here whatever the variable says.
- ``keras.datasets.mnist.load_data`` (and ``tf.keras``'s) returns an offline stand-in with
  MNIST's shapes and types (mnist_standin.py).
- HORORING_SHIM_TF1=1: TensorFlow 1 behaviour (``tf.compat.v1.disable_v2_behavior()``),
  TF1 names on ``tensorflow`` (``ConfigProto``, ``Session``), and ``import keras`` is tf-keras's
  TF1 API (``tf.compat.v1.keras``: sessions, legacy optimizers), as standalone Keras 2 was.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys

from mnist_standin import digits_as_mnist


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


def _horovod_alias():
    """hororing's own opt-in alias (hororing/alias.py), loaded by its path so that hororing
    itself is imported only when the script imports horovod."""
    spec = importlib.util.find_spec("hororing")
    location = os.path.join(list(spec.submodule_search_locations)[0], "alias.py")
    alias_spec = importlib.util.spec_from_file_location("_hororing_alias", location)
    alias = sys.modules.get("_hororing_alias") or importlib.util.module_from_spec(alias_spec)
    if "_hororing_alias" not in sys.modules:
        sys.modules["_hororing_alias"] = alias
        alias_spec.loader.exec_module(alias)
    alias.install()


def _install():
    _horovod_alias()
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
        module.load_data = digits_as_mnist


_install()
