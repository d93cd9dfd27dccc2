"""Stock architectures built for float16 as users build them, healthy and
with a planted fault, their synthetic data, and a judge of health by
training.

Each builder takes the Keras module to build with (keras, or tf_keras in the
session's tf-keras process), sets the global dtype policy to `policy`
(`mixed_float16` by default, as Keras' mixed-precision guide does it) and
leaves it set, seeds Keras' random state with `seed`, builds fresh weights
(`weights=None`: nothing is downloaded), puts the output softmax in float32,
and compiles with Adam in a `tf_lossscale.LossScaleOptimizer` (in float32:
Adam alone). The zoo (`ZOO`):

* `mobilenet_v2`: keras.applications MobileNetV2, alpha 0.35, 32x32 images,
  its layers in the model itself (its top without the softmax, then a
  float32 softmax).
* `mobilenet_v3_small`: keras.applications MobileNetV3Small without its top
  on 32x32 images, nested as one layer in a functional model with a Dense
  head and a float32 softmax (how transfer learning builds it): squeeze-and-
  excitation blocks and hard-swish, which MobileNetV2 has not.
* `transformer`: the encoder classifier of Keras' "Text classification with
  Transformer" example as a functional model: token Embedding plus a learned
  position table (`PositionEmbedding`, a registered custom layer),
  MultiHeadAttention, LayerNormalization, and the feed-forward block as a
  nested `Sequential` ("ffn").
* `bert`: KerasHub's `BertTextClassifier` on a `BertBackbone` from a small
  explicit config (no preset); only where keras-hub is installed.

Planted faults (`fault=`), each naming what the diagnosis must find:

* `HUGE_INPUTS` (image models): the images times 1e5, far beyond float16's
  65504: the first layer that casts them to float16 overflows. Only the data
  changes (`data(..., fault=HUGE_INPUTS)`).
* `HUGE_EMBEDDINGS` (text models): huge embeddings reach the first
  attention layer (the Transformer's token embeddings are drawn with a
  standard deviation of `HUGE_EMBEDDING_STDDEV`; BERT normalizes its
  embeddings, so its normalization's gamma is `BERT_EMBEDDING_GAMMA`):
  they fit float16, but the attention logits computed from them overflow
  it.
* `STUCK_SCALE` (text models and MobileNetV2): the loss scale is a
  `FixedLossScale(1.0)` and the loss is small (`tiny_crossentropy`: the
  cross-entropy times TINY_LOSS_FACTOR, as a loss weight or a mean over
  many terms makes it): at that scale its float16 gradients underflow,
  while Adam (its epsilon TINY_LOSS_EPSILON), blind to a gradient's
  magnitude, trains the float32 model as on the plain loss. Measured: the
  Transformer at scale 1 stops learning; MobileNetV2 does not (its batch
  normalizations rescale the gradients that survive), so the tests plant
  this fault in the text models only.

`train` runs a compiled model over a list of batches in order (cycling)
until a number of steps were applied and records its losses and skipped
steps;
`trains_like_float32` judges a float16 run against the float32 run of the
same architecture from the same weights (`float32_twin`): the tolerances
and why are in its docstring.
"""

import dataclasses
import functools

import numpy as np

import tf_lossscale

IMAGE_SHAPE = (32, 32, 3)
IMAGE_CLASSES = 4
IMAGE_BATCH = 8
SEQUENCE = 16
VOCABULARY = 64
TEXT_CLASSES = 2
TEXT_BATCH = 16
EMBED = 32
HEADS = 2
FEED_FORWARD = 32
BATCHES = 4
"""Distinct batches of each data set; training cycles through them."""

LEARNING_RATE = 1e-3
TEXT_LEARNING_RATE = 3e-3
"""The text models': at 1e-3 the Transformer's float32 loss falls by only
a fifth in 32 steps with Keras 3.10, too little to tell a float16 run that
does not learn."""

HUGE_INPUTS = "huge_inputs"
HUGE_INPUT_FACTOR = 1e5
HUGE_EMBEDDINGS = "huge_embeddings"
HUGE_EMBEDDING_STDDEV = 1000.0
BERT_EMBEDDING_GAMMA = 3000.0
"""BERT's huge embeddings, after its embedding normalization: at 1000 its
float16 attention still holds them (measured, keras-hub 0.32)."""
STUCK_SCALE = "stuck_scale"
FAULTS = (HUGE_INPUTS, HUGE_EMBEDDINGS, STUCK_SCALE)

TINY_LOSS_FACTOR = 1e-6
TINY_LOSS_EPSILON = 1e-12
"""Adam's epsilon with the tiny loss: its default, 1e-7, would outweigh
gradients of ~1e-8 and stall float32 too."""


# Data: numpy arrays drawn from a generator seeded with `seed`, the same on
# every machine; a learnable task so that the loss falls within a few dozen
# steps.


def image_data(seed=0, batches=BATCHES, fault=None):
    """`batches` batches of (images, labels): N(0, 1) noise plus one fixed
    pattern per class; times HUGE_INPUT_FACTOR for HUGE_INPUTS."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(1000).standard_normal(
        (IMAGE_CLASSES,) + IMAGE_SHAPE).astype(np.float32)
    count = batches * IMAGE_BATCH
    labels = rng.integers(0, IMAGE_CLASSES, count)
    x = (rng.standard_normal((count,) + IMAGE_SHAPE).astype(np.float32)
         + patterns[labels])
    if fault == HUGE_INPUTS:
        x = x * np.float32(HUGE_INPUT_FACTOR)
    return _batched(x, labels.astype(np.int32), IMAGE_BATCH)


def token_data(seed=0, batches=BATCHES):
    """`batches` batches of (token ids, labels): random tokens 2 ...
    VOCABULARY - 1, and 3 copies of the class's marker token (0 or 1) at
    random positions."""
    rng = np.random.default_rng(seed)
    count = batches * TEXT_BATCH
    labels = rng.integers(0, TEXT_CLASSES, count)
    tokens = rng.integers(2, VOCABULARY, (count, SEQUENCE))
    for row, label in enumerate(labels):
        tokens[row, rng.choice(SEQUENCE, 3, replace=False)] = label
    return _batched(tokens.astype(np.int32), labels.astype(np.int32),
                    TEXT_BATCH)


def bert_data(seed=0, batches=BATCHES):
    """`token_data` as BertTextClassifier takes it: a dict of token_ids,
    segment_ids and padding_mask."""
    return [({"token_ids": x, "segment_ids": np.zeros_like(x),
              "padding_mask": np.ones_like(x, dtype=bool)}, y)
            for x, y in token_data(seed, batches)]


def _batched(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


# Builders.


def _start(keras, policy, seed):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(seed)


def _compile(keras, model, policy, fault, from_logits=False,
             learning_rate=LEARNING_RATE):
    """Adam, in a LossScaleOptimizer unless in float32 (a FixedLossScale(1)
    for STUCK_SCALE); the cross-entropy (`tiny_crossentropy` for
    STUCK_SCALE)."""
    optimizer = keras.optimizers.Adam(
        learning_rate, epsilon=TINY_LOSS_EPSILON if fault == STUCK_SCALE
        else 1e-7)
    if policy != "float32":
        optimizer = tf_lossscale.LossScaleOptimizer(
            optimizer, tf_lossscale.FixedLossScale(1.0)
            if fault == STUCK_SCALE else "dynamic")
    if fault == STUCK_SCALE:
        loss = losses(keras)["tiny_crossentropy_from_logits" if from_logits
                             else "tiny_crossentropy"]
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=from_logits)
    model.compile(optimizer=optimizer, loss=loss)
    return model


@functools.cache
def losses(keras):
    """{name: the registered loss function} for `keras`: the sparse
    cross-entropy times TINY_LOSS_FACTOR, of probabilities or of logits."""
    registered = {}
    for from_logits in (False, True):
        name = "tiny_crossentropy" + ("_from_logits" if from_logits else "")

        def tiny(y_true, y_pred, from_logits=from_logits):
            return TINY_LOSS_FACTOR * keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=from_logits)

        tiny.__name__ = name
        registered[name] = keras.saving.register_keras_serializable(
            package="tf_lossscale_zoo", name=name)(tiny)
    return registered


def _softmax(keras, h, classes):
    """Dense logits, then a float32 softmax (Keras' mixed-precision
    guide)."""
    h = keras.layers.Dense(classes, name="logits")(h)
    return keras.layers.Activation("softmax", dtype="float32",
                                   name="probabilities")(h)


def mobilenet_v2(keras, fault=None, seed=0, policy="mixed_float16"):
    """keras.applications' MobileNetV2 (alpha 0.35) on 32x32 images, flat:
    its layers are the model's."""
    _check_fault(fault, (HUGE_INPUTS, STUCK_SCALE))
    _start(keras, policy, seed)
    base = keras.applications.MobileNetV2(
        input_shape=IMAGE_SHAPE, alpha=0.35, weights=None,
        include_top=False, pooling="avg")
    model = keras.Model(base.input,
                        _softmax(keras, base.output, IMAGE_CLASSES),
                        name="mobilenet_v2_zoo")
    return _compile(keras, model, policy, fault)


def mobilenet_v3_small(keras, fault=None, seed=0, policy="mixed_float16"):
    """keras.applications' MobileNetV3Small without its top on 32x32 images,
    nested as one layer of a functional model. Without its preprocessing
    (`include_preprocessing=False`, as for inputs already normalized, which
    `image_data`'s are: its Rescaling expects pixels in 0-255)."""
    _check_fault(fault, (HUGE_INPUTS,))
    _start(keras, policy, seed)
    base = keras.applications.MobileNetV3Small(
        input_shape=IMAGE_SHAPE, weights=None, include_top=False,
        pooling="avg", include_preprocessing=False)
    images = keras.Input(IMAGE_SHAPE, name="images")
    model = keras.Model(images,
                        _softmax(keras, base(images), IMAGE_CLASSES),
                        name="mobilenet_v3_small_zoo")
    return _compile(keras, model, policy, fault)


@functools.cache
def position_embedding_class(keras):
    """`PositionEmbedding` for `keras` (registered, so that a model holding
    it rebuilds from its config): adds a learned (sequence, features) table
    to its inputs, as the Keras example's TokenAndPositionEmbedding does."""

    @keras.saving.register_keras_serializable(package="tf_lossscale_zoo")
    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned position embedding to a (batch, sequence,
        features) input."""

        def build(self, input_shape):
            self.positions = self.add_weight(
                name="positions", shape=tuple(input_shape[1:]),
                initializer="glorot_uniform")
            super().build(input_shape)

        def call(self, inputs):
            return inputs + self.positions

    return PositionEmbedding


def transformer(keras, fault=None, seed=0, policy="mixed_float16",
                dropout=0.1):
    """The Transformer encoder classifier of Keras' text classification
    example, functional, its feed-forward block a nested Sequential
    ("ffn")."""
    _check_fault(fault, (HUGE_EMBEDDINGS, STUCK_SCALE))
    _start(keras, policy, seed)
    tokens = keras.Input((SEQUENCE,), dtype="int32", name="tokens")
    initializer = (keras.initializers.RandomNormal(
        stddev=HUGE_EMBEDDING_STDDEV) if fault == HUGE_EMBEDDINGS
                   else "uniform")
    x = keras.layers.Embedding(VOCABULARY, EMBED, name="token_embedding",
                               embeddings_initializer=initializer)(tokens)
    x = position_embedding_class(keras)(name="position_embedding")(x)
    attention = keras.layers.MultiHeadAttention(
        num_heads=HEADS, key_dim=EMBED, name="attention")(x, x)
    attention = keras.layers.Dropout(dropout, name="attention_dropout")(
        attention)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="norm_1")(
        keras.layers.Add(name="residual_1")([x, attention]))
    ffn = keras.Sequential([
        keras.layers.Dense(FEED_FORWARD, activation="relu", name="ffn_1"),
        keras.layers.Dense(EMBED, name="ffn_2"),
    ], name="ffn")(x)
    ffn = keras.layers.Dropout(dropout, name="ffn_dropout")(ffn)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="norm_2")(
        keras.layers.Add(name="residual_2")([x, ffn]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    x = keras.layers.Dropout(dropout, name="pool_dropout")(x)
    x = keras.layers.Dense(20, activation="relu", name="hidden")(x)
    x = keras.layers.Dropout(dropout, name="hidden_dropout")(x)
    model = keras.Model(tokens, _softmax(keras, x, TEXT_CLASSES),
                        name="transformer_zoo")
    return _compile(keras, model, policy, fault,
                    learning_rate=TEXT_LEARNING_RATE)


def keras_hub_or_skip_reason():
    """(keras_hub, None), or (None, why the KerasHub model cannot be
    built here)."""
    try:
        import keras_hub  # pylint: disable=g-import-not-at-top
    except ImportError as err:
        return None, (f"keras-hub is not installed ({err}): "
                      'pip install "tf_lossscale[keras-hub]"')
    return keras_hub, None


def bert(keras, fault=None, seed=0, policy="mixed_float16", dropout=0.1):
    """KerasHub's BertTextClassifier (no preprocessor) on a 2-layer
    BertBackbone built from an explicit small config; its output is
    logits (KerasHub's), the loss takes them with from_logits."""
    _check_fault(fault, (HUGE_EMBEDDINGS, STUCK_SCALE))
    keras_hub, reason = keras_hub_or_skip_reason()
    if keras_hub is None:
        raise ImportError(reason)
    _start(keras, policy, seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=HEADS,
        hidden_dim=EMBED, intermediate_dim=2 * EMBED,
        max_sequence_length=SEQUENCE, dropout=dropout)
    if fault == HUGE_EMBEDDINGS:
        # BERT normalizes its embeddings before the first transformer
        # layer: huge embeddings are huge after that normalization.
        backbone.get_layer("embeddings_layer_norm").gamma.assign(
            np.full([EMBED], BERT_EMBEDDING_GAMMA, np.float32))
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=TEXT_CLASSES, preprocessor=None,
        dropout=dropout, name="bert_zoo")
    return _compile(keras, model, policy, fault, from_logits=True,
                    learning_rate=TEXT_LEARNING_RATE)


def _check_fault(fault, known):
    if fault is not None and fault not in known:
        raise ValueError(f"fault must be one of {known} or None, got "
                         f"{fault!r}")


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One architecture of the zoo: `build(keras, fault=None, seed=0,
    policy=...)` and `data(seed=0, fault=None)`, and the faults it
    plants."""
    name: str
    build: object
    data: object
    faults: tuple


def _image_data(seed=0, fault=None):
    return image_data(seed, fault=fault)


def _token_data(seed=0, fault=None):
    del fault  # The text models' faults are in the model.
    return token_data(seed)


def _bert_data(seed=0, fault=None):
    del fault
    return bert_data(seed)


ZOO = {zoo_model.name: zoo_model for zoo_model in (
    ZooModel("mobilenet_v2", mobilenet_v2, _image_data,
             (HUGE_INPUTS, STUCK_SCALE)),
    ZooModel("mobilenet_v3_small", mobilenet_v3_small, _image_data,
             (HUGE_INPUTS,)),
    ZooModel("transformer", transformer, _token_data,
             (HUGE_EMBEDDINGS, STUCK_SCALE)),
    ZooModel("bert", bert, _bert_data, (HUGE_EMBEDDINGS, STUCK_SCALE)),
)}


# Training and its judge.


@dataclasses.dataclass
class Run:
    """What `train` saw: the loss of every step (`losses`), the steps the
    loss scale skipped (their indices), whether every weight stayed finite
    (`finite`; `trainable_finite`: the trainable ones, which a skipped step
    leaves alone, while a forward pass that overflows writes NaN into
    BatchNormalization's moving statistics, skipped or not), the final
    loss scale (None in float32)."""
    losses: list
    skipped: list
    scales: list
    finite: bool
    trainable_finite: bool
    loss_scale: object = None

    @property
    def applied(self):
        """The losses of the steps applied."""
        skipped = set(self.skipped)
        return [loss for step, loss in enumerate(self.losses)
                if step not in skipped]


def train(model, batches, steps):
    """Trains the compiled `model` on `batches` in order (cycling), one
    `train_on_batch` a step, until `steps` steps were applied (skipped
    steps, up to MAX_SKIPPED, are made up for); returns its `Run`.

    The optimizer is built before the first step: a first trace that
    creates its variables would be traced twice (seconds on these models).
    """
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    wrapped = isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    losses, skipped = [], []
    scales = [float(optimizer.loss_scale()) if wrapped else None]
    while len(losses) - len(skipped) < steps and (
            len(losses) < steps + MAX_SKIPPED):
        x, y = batches[len(losses) % len(batches)]
        logs = model.train_on_batch(x, y, return_dict=True)
        if wrapped and int(optimizer.skipped_steps) > len(skipped):
            skipped.append(len(losses))
        scales.append(float(optimizer.loss_scale()) if wrapped else None)
        losses.append(float(logs["loss"]))
    return Run(
        losses=losses, skipped=skipped, scales=scales,
        finite=all(np.isfinite(w).all() for w in model.get_weights()),
        trainable_finite=all(np.isfinite(w.numpy()).all()
                             for w in model.trainable_weights),
        loss_scale=float(optimizer.loss_scale()) if wrapped else None)


def float32_twin(zoo_model, keras, weights, fault=None, seed=0):
    """The architecture of `zoo_model` built in float32 with `weights` (a
    list as `get_weights()` gives it), compiled with the same inner
    optimizer, unwrapped. Leaves the global policy at float32: set it back
    (keras_isolation does)."""
    model = zoo_model.build(keras, fault=fault, seed=seed, policy="float32")
    model.set_weights(weights)
    return model


# The judge's tolerances, from the zoo's runs (32 steps; TF 2.21 / Keras 3.15
# and TF 2.16 / Keras 3.10, 2026-11-28, MobileNetV3Small 2026-11-29), as the
# difference of the last 8 losses' means over the float32 run's first loss:
# float16 with the wrapper against float32 from the same weights, 0.1% to
# 4.0%; float32 against float32 from other seeds, up to 14%; all-float32
# models from today's `fix` (another loss scale, skips made up), up to 12%;
# float16 runs that do not learn (scale stuck at 1 on the tiny loss), 51% to
# 95%. Overflowing faults skip every step.
LAST_LOSSES = 8
"""The judge compares the mean of this many last applied losses."""
LOSS_TOLERANCE = 0.25
"""... relative to the float32 run's first loss."""
MAX_SKIPPED = 12
"""Skipped steps a dynamic loss scale may spend calibrating (2**15 down to
2**3); `train` makes them up."""


def trains_like_float32(run, reference):
    """Why float16's `run` does not train like float32's `reference` (a list
    of reasons; empty: it does).

    Healthy: every weight finite; at most MAX_SKIPPED skipped steps, each
    of which lowered the loss scale (calibration: a scale that skips and
    stays, at its floor or fixed, is not calibrating); the mean loss of the
    last LAST_LOSSES applied steps within LOSS_TOLERANCE of the float32
    run's first loss from the float32 run's own (the float32 curves fall by
    most of that first loss in these runs, so a float16 run that does not
    learn is far outside it, while dropout masks, which differ between the
    two dtypes, and float16's rounding stay inside).
    """
    reasons = []
    if not run.finite:
        reasons.append("a weight is not finite")
    calls = len(run.losses)
    if len(run.skipped) > MAX_SKIPPED:
        reasons.append(f"{len(run.skipped)} of {calls} steps skipped")
    stuck = [step for step in run.skipped
             if run.scales[step + 1] >= run.scales[step]]
    if stuck:
        reasons.append(f"steps {stuck} of {calls} skipped without lowering "
                       "the loss scale")
    last = run.applied[-LAST_LOSSES:]
    if len(last) < LAST_LOSSES or not np.isfinite(last).all():
        reasons.append(f"fewer than {LAST_LOSSES} steps applied, or their "
                       "losses not finite")
    if reasons:
        return reasons
    mine = float(np.mean(last))
    theirs = float(np.mean(reference.applied[-LAST_LOSSES:]))
    allowed = LOSS_TOLERANCE * reference.losses[0]
    if abs(mine - theirs) > allowed:
        reasons.append(
            f"its last {LAST_LOSSES} losses average {mine:.4g}, the float32 "
            f"run's {theirs:.4g} (allowed difference {allowed:.4g})")
    return reasons
