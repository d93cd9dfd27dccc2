"""Tiny models that train in float16 for a while, then fail: their data, and
how each one's magnitudes grow (`tests/watch/test_late_failures.py`).

All three train with Lion at a learning rate large for it: its update is
the sign of a momentum that outlives the gradient, so weights keep moving
the way they went after the loss has saturated, and magnitudes grow as
powers of the step count, as they do (more slowly) in long real runs.

* `logits_classifier`: a classifier on separable data (every feature's sign
  is the label's); its float16 output layer's logits grow until they
  overflow.
* `residual_mlp`: eight residual blocks without normalization (one
  LayerNormalization before the head, as pre-norm networks end); the
  residual stream grows block over block.
* `attention_classifier`: one attention layer over token and position
  embeddings, the label a property of the first token; the attention
  logits grow (what QK-normalization addresses) until they overflow inside
  the attention layer, whose outputs stay small.

Measured here: the logits classifier fails near step 290, the residual MLP
near step 100, the attention classifier near step 200.

What the late-failure tests share to judge a failure: a float32 twin
compiled with the failed run's optimizer state (`compiled_with_state_of`),
and the first layer whose outputs leave float16's range
(`first_layer_beyond_float16`). The tests that plant a failure by hand
(a bias set beyond float16's range) share `two_layer_classifier` and its
`two_layer_data`.
"""

import numpy as np

import tf_lossscale
from tf_lossscale.ops import float16

EXAMPLES = 512
BATCH = 32
STEPS_PER_EPOCH = EXAMPLES // BATCH
TOKENS, VOCABULARY, WIDTH = 8, 16, 16


def separable_data(seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, EXAMPLES).astype("int32")
    x = np.abs(rng.standard_normal((EXAMPLES, 16))) * (2 * y[:, None] - 1)
    return x.astype("float32"), y


def linear_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((EXAMPLES, 16)).astype("float32")
    return x, (x @ rng.standard_normal(16) > 0).astype("int32")


def token_data(seed=0):
    """Each token one-hot, with its position one-hot beside it."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCABULARY, (EXAMPLES, TOKENS))
    x = np.concatenate([np.eye(VOCABULARY)[tokens], np.broadcast_to(
        np.eye(TOKENS), (EXAMPLES, TOKENS, TOKENS))], axis=-1)
    return x.astype("float32"), (tokens[:, 0] % 2).astype("int32")


def two_layer_classifier(keras, compiled=False):
    """Dense 4 -> 8 (relu, "hidden") -> 2 ("logits"), seeded, under the
    global policy mixed_float16 (set here, as users do); `compiled`: with
    SGD(0.01) in a LossScaleOptimizer of DynamicLossScale(1024, 1000) and the
    cross-entropy from logits."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(h))
    if compiled:
        model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            tf_lossscale.DynamicLossScale(1024.0, 1000)),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    return model


def two_layer_data(examples):
    """`examples` inputs of 4 features for `two_layer_classifier`, each
    labelled by its first feature's sign."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def logits_classifier(keras):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
    logits = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(inputs, logits, name="logits_classifier")


def residual_mlp(keras, blocks=8):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, name="stem")(inputs)
    for i in range(blocks):
        u = keras.layers.Dense(32, activation="relu", name=f"block{i}_a")(h)
        u = keras.layers.Dense(32, name=f"block{i}_b")(u)
        h = keras.layers.Add(name=f"block{i}_add")([h, u])
    h = keras.layers.LayerNormalization(name="final_norm")(h)
    logits = keras.layers.Dense(2, name="head", dtype="float32")(h)
    return keras.Model(inputs, logits, name="residual_mlp")


def attention_classifier(keras):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((TOKENS, VOCABULARY + TOKENS))
    h = keras.layers.Dense(WIDTH, use_bias=False, name="embed")(tokens)
    h = keras.layers.MultiHeadAttention(2, WIDTH, name="attention")(h, h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    logits = keras.layers.Dense(2, name="head", dtype="float32")(h)
    return keras.Model(tokens, logits, name="attention_classifier")


def attention_logits(model, x):
    """The largest |attention logit| of `model`'s attention layer on `x`, as
    Keras 3 computes them: the query and key products in the layer's
    compute dtype, scaled by 1/sqrt(key_dim) only after a cast to float32
    (`ops.dot_product_attention`); here all in float32."""
    import keras  # pylint: disable=g-import-not-at-top
    inputs = keras.Model(model.inputs[0], model.get_layer("embed").output)(x)
    attention = model.get_layer("attention")
    query = attention._query_dense(inputs)  # pylint: disable=protected-access
    key = attention._key_dense(inputs)  # pylint: disable=protected-access
    return float(np.abs(np.einsum("bthd,bshd->bhts", np.asarray(
        query, np.float32), np.asarray(key, np.float32))).max())


def compiled_with_state_of(twin, inner, loss):
    """Compiles `twin` (a float32 copy of a failed model, its weights set)
    with a copy of `inner`, the failed run's inner optimizer, holding its
    state; returns `twin`."""
    optimizer = type(inner).from_config(inner.get_config())
    twin.compile(optimizer=optimizer, loss=loss)
    optimizer.build(twin.trainable_variables)
    for source, target in zip(inner.variables, optimizer.variables):
        target.assign(source)
    return twin


def first_layer_beyond_float16(keras, model, x):
    """The first layer, in the order the model runs them, whose float32
    outputs exceed float16's largest value on `x` (in inference); None if
    none does."""
    layers = [layer for layer in model.layers
              if not isinstance(layer, keras.layers.InputLayer)]
    outputs = keras.Model(model.inputs[0], [l.output for l in layers])(
        x, training=False)
    return next((layer.name for layer, out in zip(layers, outputs)
                 if np.abs(np.asarray(out)).max() > float16.FLOAT16_MAX),
                None)
