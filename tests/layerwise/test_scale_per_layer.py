"""`tf_lossscale.layerwise.scale_per_layer`: the rebuilt model, its
segments and boundaries, each segment's backward pass at its own scale and
each gradient unscaled by it; what it refuses."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale import layerwise
from tests.helpers import layerwise_models as models
from tests.helpers.training import values_of

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _sequential():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((models.FEATURES,)),
        keras.layers.Dense(5, dtype="mixed_float16", name="one"),
        keras.layers.BatchNormalization(dtype="mixed_float16", name="norm"),
        keras.layers.Activation("relu", dtype="mixed_float16", name="act"),
        keras.layers.Dense(5, dtype="mixed_float16", name="two"),
        keras.layers.Dense(1, dtype="float32", name="three")])
    model.compile(tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD()),
                  "mse")
    return model


def _built_under_the_global_policy():
    # As Keras' mixed-precision guide does it; the policy is float32 again
    # when the model is scaled: the nested block must keep mixed_float16.
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = models.branched_model(policy=None)
    keras.mixed_precision.set_global_policy("float32")
    return model


def _boundaries(model):
    return [(layer.producer, layer.consumer) for layer in model.layers
            if isinstance(layer, layerwise.GradientScaling)]


@pytest.mark.parametrize("build", [
    _sequential, models.gained_model, models.branched_model,
    _built_under_the_global_policy],
                         ids=["sequential", "gained", "branched",
                              "under_the_global_policy"])
def test_scaled_model_computes_what_the_original_does_from_its_weights(build):
    model = build()
    before = values_of(model.weights)
    x, _ = models.data()

    scaled = layerwise.scale_per_layer(model)

    assert isinstance(scaled, layerwise.LayerwiseModel)
    np.testing.assert_array_equal(scaled(x), model(x))
    for layer in model.layers[1:]:  # Not the input.
        copy = scaled.get_layer(layer.name)
        assert copy is not layer
        assert copy.dtype_policy.name == layer.dtype_policy.name
    scaled.train_on_batch(x, models.data()[1])
    for now, then in zip(values_of(model.weights), before):
        np.testing.assert_array_equal(now, then)


def test_the_scaled_model_passes_training_to_its_layers():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((models.FEATURES,)),
        keras.layers.Dense(5, dtype="mixed_float16", name="one"),
        keras.layers.Dropout(0.5, name="drop"),
        keras.layers.Dense(1, dtype="float32", name="two")])
    model.compile(tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD()),
                  "mse")
    x, _ = models.data()

    scaled = layerwise.scale_per_layer(model)

    np.testing.assert_array_equal(scaled(x, training=False), model(x))
    assert not np.array_equal(scaled(x, training=True), model(x))


def test_segments_start_at_each_weighted_layer_or_where_asked():
    model = _sequential()

    by_layer = layerwise.scale_per_layer(model)
    halves = layerwise.scale_per_layer(model, segments=2)
    named = layerwise.scale_per_layer(model, segments=["three"])

    # A normalization, and a layer without weights, join the segment
    # before them.
    assert by_layer.segments == [["one", "norm", "act"], ["two"], ["three"]]
    assert _boundaries(by_layer) == [(0, 1), (1, 2)]
    assert halves.segments == [["one", "norm", "act"], ["two", "three"]]
    assert named.segments == [["one", "norm", "act", "two"], ["three"]]
    assert _boundaries(named) == [(0, 1)]


def test_magnitudes_start_segments_only_where_the_gradients_part():
    model = _sequential()

    # "two" within 2**8 of "one": one segment; "three" 2**20 below it.
    parted = layerwise.scale_per_layer(model, segments={
        "one": 1.0, "norm": 2.0 ** 30, "two": 2.0 ** -7, "three": 2.0 ** -27})

    assert parted.segments == [["one", "norm", "act", "two"], ["three"]]
    assert _boundaries(parted) == [(0, 1)]
    with pytest.raises(ValueError, match="lie within 2\\*\\*8 of each other"):
        layerwise.scale_per_layer(model, segments={
            "one": 1.0, "two": 2.0 ** 8, "three": None})


def test_boundaries_sit_on_every_edge_between_segments_of_a_branched_model():
    model = models.branched_model()

    scaled = layerwise.scale_per_layer(model)

    # The nested block is one layer; the stem's output enters segment 1
    # twice (the block, the residual) through one boundary; the shared
    # layer's two calls are one segment, with none between them.
    assert scaled.segments == [["stem"], ["block", "residual"], ["shared"],
                               ["head"]]
    assert sorted(_boundaries(scaled)) == [(0, 1), (1, 2), (2, 3)]


def _float32_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
    return tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("build", [models.gained_model,
                                   models.branched_model],
                         ids=["gained", "branched"])
def test_each_segment_runs_at_its_scale_and_is_unscaled_by_it(build):
    # In float32 a power-of-two scale is exact: the scaled model's gradients
    # are the plain model's times S * F of their segment, bit for bit, and
    # one SGD step with learning rate 1 moves each weight by exactly its
    # plain gradient.
    model = build("float32")
    x, y = models.data(batches=1)
    expected = _float32_gradients(model, x, y)
    scale = 2.0**5
    scaled = layerwise.scale_per_layer(model, min_factor=2.0**-8)
    scaled.compile(tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), tf_lossscale.DynamicLossScale(scale)),
        "mse")
    lower = len(scaled.segments) - 1
    factors = 2.0 ** np.arange(-2, 3 * lower - 2, 3, dtype=np.float32)
    scaled.non_trainable_weights[0].assign(factors)  # gradient_factors
    segment = {id(v): index for index, names in enumerate(scaled.segments)
               for name in names
               for v in scaled.get_layer(name).trainable_weights}
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y, scaled(x)))
        scaled_loss = scaled.optimizer.scale_loss(loss)
    grads = tape.gradient(scaled_loss, scaled.trainable_variables)
    for grad, want, variable in zip(grads, expected,
                                    scaled.trainable_variables):
        index = segment[id(variable)]
        factor = factors[index] if index < lower else 1.0
        np.testing.assert_array_equal(grad.numpy(),
                                      want.numpy() * scale * factor)
    before = values_of(scaled.trainable_variables)

    scaled.optimizer.apply(grads, scaled.trainable_variables)

    for now, then, want in zip(values_of(scaled.trainable_variables),
                               before, expected):
        np.testing.assert_array_equal(now, then - want.numpy())


def test_compile_settings_and_the_loss_scale_config_carry_over():
    model = models.branched_model()
    model.compile(tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.25, momentum=0.5),
        tf_lossscale.DynamicLossScale(64, increment_period=7)),
        "mae", metrics=["mse"])

    scaled = layerwise.scale_per_layer(model)

    optimizer = scaled.optimizer
    assert isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    assert optimizer is not model.optimizer
    assert optimizer.inner_optimizer.get_config() == (
        model.optimizer.inner_optimizer.get_config())
    assert optimizer.loss_scale.get_config() == (
        model.optimizer.loss_scale.get_config())
    assert scaled.loss == "mae"
    assert scaled.get_compile_config()["metrics"] == (
        model.get_compile_config()["metrics"])


def test_compile_wraps_a_plain_optimizer_and_refuses_a_scale_that_never_skips():
    scaled = layerwise.scale_per_layer(models.gained_model())
    scaled.compile(keras.optimizers.SGD(), "mse")
    assert isinstance(scaled.optimizer, tf_lossscale.LossScaleOptimizer)
    assert scaled.optimizer.dynamic
    fixed = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(), 128)
    with pytest.raises(ValueError, match="skip_non_finite=True"):
        scaled.compile(fixed, "mse")


def test_a_plain_optimizer_is_wrapped_with_the_default_loss_scale():
    model = models.gained_model()
    model.compile(keras.optimizers.SGD(0.25, momentum=0.5), "mse")

    scaled = layerwise.scale_per_layer(model)

    optimizer = scaled.optimizer
    assert isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    assert optimizer.inner_optimizer is not model.optimizer
    assert optimizer.inner_optimizer.get_config() == (
        model.optimizer.get_config())
    assert optimizer.loss_scale.get_config() == (
        tf_lossscale.DynamicLossScale().get_config())


def _with_middle(layer):
    """Dense, `layer`, Dense; compiled."""
    keras.utils.set_random_seed(0)
    x = keras.Input((models.FEATURES,))
    h = keras.layers.Dense(5, dtype="mixed_float16", name="one")(x)
    h = layer(h)
    out = keras.layers.Dense(1, dtype="float32", name="two")(h)
    model = keras.Model(x, out)
    model.compile(tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD()),
                  "mse")
    return model


class _UnrebuildableScaling(keras.layers.Layer):
    """A layer without state whose config lacks an argument it needs."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor

    def get_config(self):  # A user's, which forgot `factor`.
        config = super().get_config()
        config.pop("factor", None)
        return config


def test_a_layer_without_state_that_cannot_be_rebuilt_is_shared():
    # As a Lambda is, where Keras' safe mode will not rebuild it.
    doubled = _UnrebuildableScaling(2.0, name="doubled")
    model = _with_middle(doubled)
    x, _ = models.data()

    scaled = layerwise.scale_per_layer(model)

    assert scaled.get_layer("doubled") is doubled
    np.testing.assert_array_equal(scaled(x), model(x))


class _Unrebuildable(keras.layers.Layer):
    """A layer with a weight whose config lacks an argument it needs."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units))

    def call(self, inputs):
        return inputs @ self.kernel

    def get_config(self):  # A user's, which forgot `units`.
        config = super().get_config()
        config.pop("units", None)
        return config


def test_a_layer_with_weights_that_cannot_be_rebuilt_is_refused_by_name():
    model = _with_middle(_Unrebuildable(3, name="custom"))

    with pytest.raises(TypeError, match="could not rebuild layer 'custom' "
                       "from its config"):
        layerwise.scale_per_layer(model)


def test_get_unscaled_gradients_is_refused_for_a_scaled_model():
    scaled = layerwise.scale_per_layer(models.gained_model())
    with pytest.raises(ValueError, match="scale_loss"):
        scaled.optimizer.get_unscaled_gradients([tf.ones([2])])


class _Subclassed(keras.Model):

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)


def _subclassed():
    model = _Subclassed()
    model(tf.ones([1, models.FEATURES]))
    model.compile("sgd", "mse")
    return model


def _not_built():
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def _not_compiled():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return model


@pytest.mark.parametrize("make, error, message", [
    (_subclassed, TypeError, "subclassed"),
    (_not_built, TypeError, "not built"),
    (_not_compiled, TypeError, "not compiled"),
    (lambda: "model", TypeError, "Keras 3 model"),
    (lambda: layerwise.scale_per_layer(models.gained_model()), ValueError,
     "scaled per layer already"),
], ids=["subclassed", "not_built", "not_compiled", "not_a_model",
        "scaled_already"])
def test_models_it_cannot_rebuild_are_refused_by_name(make, error, message):
    with pytest.raises(error, match=message):
        layerwise.scale_per_layer(make())


@pytest.mark.parametrize("segments, error, message", [
    (["nowhere"], ValueError, "names no top-level layer"),
    (1, ValueError, "makes one segment"),
    (9, ValueError, "more segments than"),
    ("blocks", TypeError, "segments must be"),
    (2.5, TypeError, "segments must be"),
    ({"one": 1.0, "nowhere": 1.0}, ValueError, "names no top-level layer"),
    ({"one": -1.0, "three": 1.0}, ValueError, "must be >= 0"),
])
def test_bad_segments_are_refused_by_name(segments, error, message):
    with pytest.raises(error, match=message):
        layerwise.scale_per_layer(_sequential(), segments=segments)


def test_a_tf_keras_model_is_refused_by_name(tf_keras_interpreter):
    printed = tf_keras_interpreter.run(
        "import tf_keras\n"
        "from tf_lossscale import layerwise\n"
        "model = tf_keras.Sequential(\n"
        "    [tf_keras.Input((2,)), tf_keras.layers.Dense(1)], name='old')\n"
        "model.compile('sgd', 'mse')\n"
        "try:\n"
        "    layerwise.scale_per_layer(model)\n"
        "except TypeError as err:\n"
        "    print(err)\n")
    assert printed == ["model 'old' is a tf-keras model: per-layer scaling "
                       "rebuilds Keras 3 functional and Sequential models"]
