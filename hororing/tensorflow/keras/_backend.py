"""Which Keras the Keras binding serves: Keras 3, or tf-keras where TensorFlow is told to.

TensorFlow's switch ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` the tf-keras package (the
Keras 2 line); the callbacks and ``load_model`` then follow it, as ``tf.keras`` does.
"""

from ...environment import launch_environment


def legacy_keras_requested():
    return launch_environment().legacy_keras


if legacy_keras_requested():
    try:
        import tf_keras as keras
    except ImportError as error:
        raise ImportError("TF_USE_LEGACY_KERAS=1 asks for tf-keras, which is not installed: "
                          "pip install tf-keras (or unset TF_USE_LEGACY_KERAS for Keras 3)"
                          ) from error
else:
    import keras

__all__ = ["keras", "keras_session", "legacy_keras_requested"]


def keras_session():
    """The session tf-keras runs a TF1 graph in (its variables initialised on first use).

    Only a TF1 program (tf-keras with v2 behaviour disabled) has one; Keras 3 is eager.
    """
    import tensorflow as tf
    return tf.compat.v1.keras.backend.get_session()
