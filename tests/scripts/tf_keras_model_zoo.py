"""The float16 diagnosis on the model zoo with tf-keras.

Not a test: `tests/diagnosis/test_model_zoo.py` calls `run(name, fault,
steps, diagnose_arguments)` in the session's `tf_keras_interpreter`
(`TF_USE_LEGACY_KERAS=1`, so `tf.keras` is tf-keras), which answers "ok" or
what failed. The checks are those of the Keras 3 tests: a healthy model gets
no float32 advice and `fix` keeps it float16 and training like float32; a
planted fault is named and `fix` makes it train like float32. The model zoo
builds with tf_keras (tf_keras.applications for MobileNetV2).
"""

import traceback

import numpy as np
import tensorflow as tf

import tf_lossscale
from tests.helpers import model_zoo

keras = tf.keras

CULPRITS = {
    ("mobilenet_v2", model_zoo.HUGE_INPUTS): "Conv1",
    ("transformer", model_zoo.HUGE_EMBEDDINGS): "attention",
}


def _walk(layers):
    for layer in layers:
        yield layer
        yield from _walk(getattr(layer, "layers", ()))


def _computing_layers(model):
    return {layer.name: layer.compute_dtype for layer in _walk(model.layers)
            if layer.weights and not getattr(layer, "layers", None)}


def _check(name, fault, steps, diagnose_arguments):
    assert "tf_keras" in keras.__name__, keras.__name__
    zoo_model = model_zoo.ZOO[name]
    model = zoo_model.build(keras, fault)
    weights = model.get_weights()
    data = zoo_model.data(0, fault)
    report = tf_lossscale.diagnose(model, data, **diagnose_arguments)
    keras.mixed_precision.set_global_policy("mixed_float16")
    if fault is None:
        assert report.keep_in_float32 == [], report.advice()
    else:
        # The premise: the fault makes the float16 forward pass overflow.
        assert not np.isfinite(model(data[0][0], training=False)).all()
        culprit = CULPRITS[name, fault]
        assert culprit in report.keep_in_float32, report.advice()
    fixed = report.fix(model)
    layers = _computing_layers(fixed)
    if fault is None:
        assert layers == _computing_layers(model), layers
    else:
        assert layers[CULPRITS[name, fault]] == "float32", layers
        assert list(layers.values()).count("float16") >= 3 * len(layers) // 4
    run = model_zoo.train(fixed, data, steps)
    reference = model_zoo.train(
        model_zoo.float32_twin(zoo_model, keras, weights, fault), data, steps)
    reasons = model_zoo.trains_like_float32(run, reference)
    assert reasons == [], reasons


def run(name, fault, steps, diagnose_arguments):
    """"ok", or the traceback of what failed."""
    try:
        _check(name, fault, steps, diagnose_arguments)
    except Exception:  # pylint: disable=broad-except
        return traceback.format_exc()
    return "ok"
