"""``import hororing.keras as hvd``: the same API as ``hororing.tensorflow.keras``.

Keras 3 is one package whatever the import path, so Horovod's two Keras modules are one here.
"""

from ..tensorflow.keras import *  # noqa: F401,F403
from ..tensorflow.keras import __all__, callbacks, load_model  # noqa: F401
