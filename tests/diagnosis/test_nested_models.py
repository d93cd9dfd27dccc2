"""`diagnose` and `fix` on models as Keras' examples build them.

Built under the global mixed_float16 policy and left so: a functional model
holding a Sequential block (the feed-forward block of Keras' Transformer
examples) and a functional block, a layer called twice, and a block whose
config lists no layers (as a KerasHub backbone's). Layers inside blocks are
rows named by path; a fault inside a block is named and fixed there, and
the fixed model computes as intended, in memory and, where the config can
say so, after saving and loading.
"""

import keras
import numpy as np
import pytest

import tf_lossscale

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("diagnosis_nested_models")]

_SCALES = [2.0**k for k in range(0, 33, 4)]


def _encoder(fault=False):
    """A Transformer encoder classifier under the global mixed_float16
    policy: attention, then a nested Sequential feed-forward block and a
    nested functional block. `fault`: the block's first layer multiplies
    by ~1e5, beyond float16's range."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(40, 16, name="embedding")(tokens)
    h = keras.layers.LayerNormalization(name="norm_1")(
        h + keras.layers.MultiHeadAttention(2, 8, name="attention")(h, h))
    scale = 1e5 if fault else 1.0
    ffn = keras.Sequential([
        keras.layers.Dense(
            32, activation="relu", name="up",
            kernel_initializer=keras.initializers.RandomNormal(
                stddev=0.2 * scale, seed=1)),
        # Keras 3's normalization takes float32 inputs as they are.
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(16, name="down"),
    ], name="ffn")
    h = keras.layers.LayerNormalization(name="norm_2")(h + ffn(h))
    inner = keras.Input((16,))
    head = keras.Model(inner, keras.layers.Dense(
        8, activation="relu", name="project")(inner), name="head")
    h = head(keras.layers.GlobalAveragePooling1D(name="pool")(h))
    out = keras.layers.Dense(3, activation="softmax", dtype="float32",
                             name="out")(h)
    model = keras.Model(tokens, out, name="encoder")
    model.compile(tf_lossscale.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                  "sparse_categorical_crossentropy")
    return model


def _data(batches=2):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 40, (8, 8)).astype(np.int32),
             rng.integers(0, 3, 8)) for _ in range(batches)]


def _compute_dtypes(model):
    """{path: compute dtype} of every layer, inside nested models too."""
    found = {}
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found.update({f"{layer.name}/{name}": dtype for name, dtype in
                          _compute_dtypes(layer).items()})
        elif not isinstance(layer, keras.layers.InputLayer):
            found[layer.name] = layer.compute_dtype
    return found


@pytest.fixture(scope="module")
def healthy():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _encoder()
    report = tf_lossscale.diagnose(model, _data(), scales=_SCALES,
                                   verbose=0)
    return model, report


def test_layers_inside_nested_models_are_rows_named_by_path(healthy):
    _, report = healthy
    names = [row["name"] for row in report.as_dict()["layers"]]

    assert {"ffn/up", "ffn/down", "head/project", "attention"} <= set(names)
    assert not {"ffn", "head"} & set(names)
    variables = {row["name"]: row["layer"]
                 for row in report.as_dict()["variables"]}
    assert variables["ffn/up/kernel"] == "ffn/up"
    assert report.keep_in_float32 == []


def test_fix_of_a_healthy_nested_model_keeps_every_layer_float16(healthy):
    model, report = healthy

    fixed = report.fix(model)

    assert _compute_dtypes(fixed) == _compute_dtypes(model)
    assert _compute_dtypes(fixed)["ffn/up"] == "float16"


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _encoder(fault=True)
    data = _data()
    report = tf_lossscale.diagnose(model, data, scales=_SCALES, verbose=0)
    fixed = report.fix(model)
    path = tmp_path_factory.mktemp("nested") / "fixed.keras"
    fixed.save(path)
    return model, data, report, fixed, keras.saving.load_model(path)


def test_a_fault_inside_a_block_is_named_by_its_path(faulty):
    _, _, report, _, _ = faulty

    assert report.first_nonfinite_layer == "ffn/up"
    assert report.keep_in_float32[0] == "ffn/up"
    assert any("'ffn/up'" in line for line in report.advice())


def test_fix_changes_the_layer_inside_the_block_and_it_saves(faulty):
    model, data, report, fixed, loaded = faulty
    expected = dict(_compute_dtypes(model),
                    **{name: "float32" for name in report.keep_in_float32})

    assert _compute_dtypes(fixed) == expected
    assert _compute_dtypes(loaded) == expected
    # The fault is gone: the forward pass is finite, and the rest of the
    # block still computes in float16.
    assert "ffn/down" not in report.keep_in_float32
    assert _compute_dtypes(fixed)["ffn/down"] == "float16"
    for x, _ in data:
        assert np.isfinite(fixed(x)).all()
        np.testing.assert_array_equal(fixed(x), loaded(x))


def test_a_layer_called_twice_is_measured_over_both_calls():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    left, right = keras.Input((4,)), keras.Input((4,))
    shared = keras.layers.Dense(8, name="shared")
    h = keras.layers.Concatenate(name="join")([shared(left), shared(right)])
    out = keras.layers.Dense(1, dtype="float32", name="out")(h)
    model = keras.Model([left, right], out)
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    # The right input is 100 times the left: its call has the largest
    # outputs.
    x = [rng.standard_normal((8, 4)).astype(np.float32),
         100 * rng.standard_normal((8, 4)).astype(np.float32)]
    y = np.ones((8, 1), np.float32)

    report = tf_lossscale.diagnose(model, [(x, y)], scales=[1.0], verbose=0)

    row = next(r for r in report.as_dict()["layers"] if r["name"] == "shared")
    kernel, bias = (w.numpy() for w in shared.weights)
    largest = max(np.abs(part @ kernel + bias).max() for part in x)
    assert row["activation_max_float32"] == pytest.approx(largest, rel=1e-5)
    assert report.keep_in_float32 == []


@keras.saving.register_keras_serializable(package="tf_lossscale_tests")
class Backbone(keras.Model):
    """A functional model whose config holds its sizes, not its layers, as
    a KerasHub backbone's does."""

    def __init__(self, units=8, gain=1.0, **kwargs):
        inputs = keras.Input((units,))
        h = keras.layers.Dense(
            units, name="block_0",
            kernel_initializer=keras.initializers.RandomNormal(
                stddev=gain, seed=3))(inputs)
        h = keras.layers.LayerNormalization(name="block_0_norm")(h)
        h = keras.layers.Dense(units, name="block_1")(h)
        super().__init__(inputs, h, **kwargs)
        self.units, self.gain = units, gain

    def get_config(self):
        return {"name": self.name, "units": self.units, "gain": self.gain}


def test_fix_inside_a_block_whose_config_lists_no_layers_warns_it_will_not_save():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = Backbone(gain=1e5, name="backbone")(inputs)
    out = keras.layers.Dense(2, activation="softmax", dtype="float32",
                             name="out")(h)
    model = keras.Model(inputs, out)
    model.compile("sgd", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((8, 8)).astype(np.float32),
             rng.integers(0, 2, 8))]
    report = tf_lossscale.diagnose(model, data, scales=[1.0], verbose=0)
    assert report.keep_in_float32 == ["backbone/block_0"]

    with pytest.warns(UserWarning, match=r"\['backbone/block_0'\] .* cannot "
                      "say so"):
        fixed = report.fix(model)

    assert _compute_dtypes(fixed)["backbone/block_0"] == "float32"
    assert _compute_dtypes(fixed)["backbone/block_1"] == "float16"
    assert np.isfinite(fixed(data[0][0])).all()


def test_fix_that_leaves_no_layer_in_float16_says_mixed_precision_is_off():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="first")(inputs)
    out = keras.layers.Dense(1, dtype="float32", name="out")(h)
    model = keras.Model(inputs, out)
    model.compile("sgd", "mse")
    # Inputs far beyond float16's range.
    x = np.full((8, 4), 1e6, np.float32)

    report = tf_lossscale.diagnose(model, [(x, np.ones((8, 1)))],
                                   scales=[1.0], verbose=0)
    with pytest.warns(UserWarning, match="mixed precision is off"):
        fixed = report.fix(model)

    assert set(_compute_dtypes(fixed).values()) == {"float32"}
    assert np.isfinite(fixed(x)).all()
