"""``import horovod`` as hororing, for scripts and libraries written for Horovod: opt-in.

With ``HORORING_AS_HOROVOD=1`` in a process's environment (``hororun --as-horovod`` sets it for
the ranks; export it yourself for ``mpirun`` or ``srun``), ``horovod``, ``horovod.torch``,
``horovod.tensorflow``, ``horovod.tensorflow.keras`` and ``horovod.keras`` (and their
submodules) are hororing's modules, one module object under both names. What hororing does
not have fails on import, saying so: ``horovod.spark``, ``horovod.ray`` and ``horovod.mxnet``
(hororing runs under an MPI launcher, for PyTorch, TensorFlow and Keras). Where a real Horovod
is installed beside hororing, the alias still answers, with a warning naming the Horovod it
hides; without the variable, ``import horovod`` is whatever is installed.

The wheel's ``hororing-horovod-alias.pth`` loads this file when Python starts and the variable
is set at all, by its path and without importing hororing (whose import starts MPI); the
finder imports hororing only when the script imports ``horovod``. The variable is read with
config.py's rule (``config.as_horovod``). Nothing here runs for a process without it.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

__all__ = ["ABSENT", "HorovodAlias", "install", "install_if_asked", "installed"]

# Horovod's modules hororing has no counterpart for, and why
ABSENT = {
    "spark": "Horovod on Spark (horovod.spark.run, estimators): launch with hororun or mpirun "
             "(or srun) instead; Spark's TorchDistributor starts processes MPI does not join",
    "ray": "Horovod on Ray (RayExecutor): launch with hororun or mpirun instead",
    "mxnet": "the MXNet binding: hororing binds PyTorch, TensorFlow and Keras",
}


class HorovodAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``horovod`` and ``horovod.X`` as ``hororing`` and ``hororing.X``.

    Args:
        real: where a real Horovod is installed (a path), or None.
    """

    def __init__(self, real=None):
        self.real = real
        self._warned = False

    def find_spec(self, name, path=None, target=None):
        if name != "horovod" and not name.startswith("horovod."):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        tail = spec.name[len("horovod"):]
        first = tail[1:].split(".")[0]
        if first in ABSENT:
            raise ModuleNotFoundError(
                f"No module named {spec.name!r}: HORORING_AS_HOROVOD makes 'horovod' hororing, "
                f"which has no {ABSENT[first]}", name=spec.name)
        if self.real is not None and not self._warned:
            self._warned = True
            warnings.warn(f"HORORING_AS_HOROVOD is set: 'import horovod' gives hororing, not the "
                          f"Horovod installed at {self.real}; unset HORORING_AS_HOROVOD to use "
                          f"that Horovod", RuntimeWarning, stacklevel=2)
        target = "hororing" + tail
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as error:
            if error.name != target:
                raise  # a dependency of hororing's module (torch, tensorflow) is missing
            raise ModuleNotFoundError(
                f"No module named {spec.name!r}: HORORING_AS_HOROVOD makes 'horovod' hororing, "
                f"which has no {target}; it provides horovod, horovod.torch, "
                f"horovod.tensorflow, horovod.tensorflow.keras and horovod.keras",
                name=spec.name) from None

    def exec_module(self, module):
        pass  # hororing's module is already executed


def installed():
    """The alias in ``sys.meta_path``, or None."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "HorovodAlias" and hasattr(finder, "real"):
            return finder
    return None


def install():
    """Put the alias first in ``sys.meta_path`` (once); return it."""
    finder = installed()
    if finder is None:
        real = importlib.machinery.PathFinder.find_spec("horovod")  # an installed Horovod
        where = None
        if real is not None:
            where = real.origin or next(iter(real.submodule_search_locations or []), "")
        finder = HorovodAlias(where)
        sys.meta_path.insert(0, finder)
    return finder


def install_if_asked(environ=None):
    """Install the alias if ``HORORING_AS_HOROVOD`` says so; return whether it is installed.
    A value that is not a yes or a no is named on stderr, and nothing is installed."""
    try:
        asked = _config().as_horovod(environ)
    except ValueError as error:
        sys.stderr.write(f"hororing: {error}; 'import horovod' is left as it is\n")
        return False
    if asked:
        install()
    return asked


def _config():
    """hororing's config.py, also where hororing is not imported (at start-up)."""
    module = sys.modules.get("hororing.config") or sys.modules.get("_hororing_config")
    if module is None:
        location = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")
        spec = importlib.util.spec_from_file_location("_hororing_config", location)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module
