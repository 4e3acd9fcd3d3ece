"""Which Keras the Keras binding serves: Keras 3, or tf-keras where TensorFlow is told to.

TensorFlow's switch ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` the tf-keras package (the
Keras 2 line); the callbacks and ``load_model`` then follow it, as ``tf.keras`` does.
"""

import os


def legacy_keras_requested():
    return os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")


if legacy_keras_requested():
    try:
        import tf_keras as keras
    except ImportError as error:
        raise ImportError("TF_USE_LEGACY_KERAS=1 asks for tf-keras, which is not installed: "
                          "pip install tf-keras (or unset TF_USE_LEGACY_KERAS for Keras 3)"
                          ) from error
else:
    import keras

__all__ = ["keras", "legacy_keras_requested"]
