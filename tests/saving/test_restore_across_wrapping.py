"""Optimizer state survives wrapping and unwrapping, restored in any order.

Moving a project into mixed precision restores a checkpoint written with a
plain Keras optimizer into the same optimizer wrapped in a
`LossScaleOptimizer`, usually before the optimizer is built (Keras builds it
at the first step); moving back is the reverse. For every built-in Keras
optimizer, plain to wrapped, wrapped to plain and wrapped to wrapped, restored
before or after the optimizer is built, in a custom loop and in `model.fit`,
the step after the restore must be the one the uninterrupted run takes, bit
for bit, and leave the optimizer in the same state. Both runs happen here, in
float32, where a power-of-two loss scale changes no bit of the gradients. The
matrix trains eagerly; the usual order traced (`fit`, `tf.function`) is
checked for three optimizers. A float32 project moving to mixed_float16 (and
back) is checked against the step from the saved state set by hand. `.keras`
files have their own paths, tested at the end.

Each saved run is made once and shared by the cases that restore it, and the
models are built once and set back to their seeded weights before each use:
building a Keras model costs more than the step a case takes.
"""

import functools
import pathlib
import typing
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures import make_fixtures
from tests.helpers import training
from tests import helpers
from tests.helpers.models import tiny_model
from tf_lossscale import LossScaleOptimizer

# One xdist worker runs the file, so each saved run is made once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("restore_across_wrapping")]

_FIXTURES = helpers.FIXTURES

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "adafactor": lambda: keras.optimizers.Adafactor(0.1),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
}

# Custom loops and `fit`, eager or traced. Tracing costs four times the step
# and restores nothing differently (`fit` builds the optimizer before it
# traces), so the matrix runs eagerly and a few cases run traced.
LOOPS = ("eager_loop", "traced_loop", "eager_fit", "fit")
DIRECTIONS = [("plain", "wrapped"), ("wrapped", "plain"),
              ("wrapped", "wrapped")]
BATCH = 8
STEPS_BEFORE_SAVE = 2


def _optimizer(name, kind):
    """OPTIMIZERS[name]() as `kind`: "plain", "wrapped" (in ours) or
    "keras_wrapped" (in Keras' own `LossScaleOptimizer`)."""
    inner = OPTIMIZERS[name]()
    if kind == "keras_wrapped":
        return keras.mixed_precision.LossScaleOptimizer(inner)
    return LossScaleOptimizer(inner) if kind == "wrapped" else inner


def _inner(optimizer):
    """The plain optimizer: itself, or the one a wrapper wraps."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def _state_of(optimizer):
    """What the optimizer carries from step to step (iterations first)."""
    return [np.asarray(v.numpy()) for v in _inner(optimizer).variables]


def _custom_loop(model, optimizer, traced=False):
    """Trains on each batch of `(x, y)`, eagerly or with one traced step."""

    def step(x, y):
        with tf.GradientTape() as tape:
            prediction = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_mean(tf.square(prediction - y))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if traced:
        step = tf.function(step)

    def train(x, y):
        for start in range(0, len(x), BATCH):
            step(x[start:start + BATCH], y[start:start + BATCH])

    return train


def _fit_on(model, x, y):
    """One epoch of `model.fit` on `(x, y)` in batches of BATCH, in order.
    A dataset of the arrays, which are the same batches: fit's own slicing
    of numpy arrays traces three functions at every call."""
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
              epochs=1, shuffle=False, verbose=0)


def _trainer(model, optimizer, loop):
    """A function training `model` on `(x, y)` in one of LOOPS."""
    if loop.endswith("_loop"):
        return _custom_loop(model, optimizer, traced=loop == "traced_loop")
    model.compile(optimizer=optimizer, loss="mse",
                  run_eagerly=loop == "eager_fit")
    return functools.partial(_fit_on, model)


def _assert_same(actual, expected, what):
    assert len(actual) == len(expected), what
    for index, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_array_equal(a, e, err_msg=f"{what} {index}")


def _snapshot(model, optimizer):
    """The weights and optimizer state `_assert_continues_as` compares."""
    return [w.numpy() for w in model.weights], _state_of(optimizer)


def _assert_continues_as(model, optimizer, expected):
    weights, state = expected
    _assert_same([w.numpy() for w in model.weights], weights,
                 "weight after the next step")
    _assert_same(_state_of(optimizer), state,
                 "optimizer variable after the next step")


@pytest.fixture(scope="module")
def fresh_model():
    """`(seed, use) -> tiny_model(seed)` as just built: one model per seed and
    use (a loop, a policy), its weights set back to the seeded ones at each
    call. A restore or a run needs those values, not a new object; fit
    loops compile it again with their optimizer."""
    built = {}

    def fresh(seed, use):
        if (seed, use) not in built:
            model = tiny_model(seed)
            built[seed, use] = model, training.values_of(model.weights)
        model, seeded = built[seed, use]
        for weight, value in zip(model.weights, seeded, strict=True):
            weight.assign(value)
        return model

    return fresh


class SavedRun(typing.NamedTuple):
    """A run of `saved_run`."""

    checkpoint: str  # Written after STEPS_BEFORE_SAVE steps.
    keras_file: pathlib.Path | None  # The same state, `.keras`; `fit` only.
    at_save: tuple  # (weights, optimizer state) when saved.
    after_next: tuple  # Where the uninterrupted run's next step took them.


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, fresh_model):
    """`(name, kind, loop) -> SavedRun`: one run per optimizer, kind and loop,
    shared by the cases that restore it."""
    directory = tmp_path_factory.mktemp("saved_runs")

    @functools.cache
    def run(name, kind, loop):
        model = fresh_model(0, loop)
        optimizer = _optimizer(name, kind)
        train = _trainer(model, optimizer, loop)
        # Built before the first step, which a traced loop then traces once
        # instead of twice (creating variables); the values are the same.
        optimizer.build(model.trainable_variables)
        train(*training.normal_data(BATCH, STEPS_BEFORE_SAVE))
        stem = directory / f"{name}_{kind}_{loop}"
        checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer).write(str(stem))
        keras_file = None
        if loop == "fit":
            keras_file = stem.with_suffix(".keras")
            model.save(keras_file)
        at_save = _snapshot(model, optimizer)
        train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))
        return SavedRun(checkpoint, keras_file, at_save,
                        _snapshot(model, optimizer))

    return run


@pytest.mark.parametrize("loop", ["eager_loop", "eager_fit"])
@pytest.mark.parametrize("build_first", [False, True],
                         ids=["restored_before_build", "restored_after_build"])
@pytest.mark.parametrize("saved_by, restored_into", DIRECTIONS,
                         ids=[f"{a}_to_{b}" for a, b in DIRECTIONS])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_next_step_after_restore_is_the_uninterrupted_one(
        name, saved_by, restored_into, build_first, loop, saved_run,
        fresh_model):
    run = saved_run(name, saved_by, loop)
    model = fresh_model(1, loop)
    optimizer = _optimizer(name, restored_into)
    train = _trainer(model, optimizer, loop)
    if build_first:
        optimizer.build(model.trainable_variables)

    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        run.checkpoint).expect_partial()
    train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))

    _assert_continues_as(model, optimizer, run.after_next)


class _GrowingSGD(keras.optimizers.SGD):
    """SGD whose learning rate grows by half at every variable update. The
    factor is a `tf.Variable` made in `build`: state outside the optimizer's
    `variables`, saved only under its attribute's name."""

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._growth = tf.Variable(1.0, trainable=False)

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate * self._growth)
        self._growth.assign(self._growth * 1.5)


@pytest.mark.parametrize("saved_by, restored_into", DIRECTIONS,
                         ids=[f"{a}_to_{b}" for a, b in DIRECTIONS])
def test_custom_optimizer_state_outside_its_variables_restores_before_build(
        saved_by, restored_into, tmp_path, fresh_model):
    def run(kind, seed):
        model = fresh_model(seed, "eager_loop")
        optimizer = _GrowingSGD(0.01)
        if kind == "wrapped":
            optimizer = LossScaleOptimizer(optimizer)
        return model, optimizer, _custom_loop(model, optimizer)

    source, source_optimizer, train = run(saved_by, seed=0)
    train(*training.normal_data(BATCH, STEPS_BEFORE_SAVE))
    path = tf.train.Checkpoint(model=source, optimizer=source_optimizer).write(
        str(tmp_path / "saved"))
    train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))
    model, optimizer, train = run(restored_into, seed=1)

    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        path).expect_partial()
    train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))

    _assert_continues_as(model, optimizer, _snapshot(source, source_optimizer))
    assert float(_inner(optimizer)._growth) == float(  # pylint: disable=protected-access
        _inner(source_optimizer)._growth)  # pylint: disable=protected-access


# Other wrappers' checkpoints list their own variables under `_variables`
# (0.1.0: placeholders and `skipped_steps`; Keras 3: its scale and counter),
# not the inner optimizer's: restored before the build, nothing of theirs may
# land in the inner optimizer's slots.


@pytest.mark.parametrize("build_first", [False, True],
                         ids=["restored_before_build", "restored_after_build"])
def test_keras_wrapper_checkpoint_gives_its_inner_state_in_any_order(
        build_first, saved_run, fresh_model):
    run = saved_run("adam", "keras_wrapped", "eager_loop")
    model = fresh_model(1, "eager_loop")
    optimizer = _optimizer("adam", "wrapped")
    if build_first:
        optimizer.build(model.trainable_variables)

    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        run.checkpoint).expect_partial()
    _custom_loop(model, optimizer)(
        *training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))

    _assert_continues_as(model, optimizer, run.after_next)


@pytest.mark.parametrize("version", ["v0_1", "v0_2", "v0_3", "v0_4",
                                     "v0_5"])
def test_earlier_wrapper_checkpoints_restore_before_build(version):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = make_fixtures.model()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                   loss_scale=make_fixtures.loss_scale())

    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        str(_FIXTURES / f"checkpoint_{version}" / "model"))
    optimizer.build(model.trainable_variables)

    status.assert_consumed()

    with np.load(_FIXTURES / f"expected_{version}.npz") as expected:
        for key, value in make_fixtures.optimizer_state(optimizer).items():
            np.testing.assert_array_equal(value, expected[f"optimizer_{key}"],
                                          err_msg=key)
        _assert_same(make_fixtures.inner_slots(optimizer),
                     [expected[f"slot_{i}"] for i in range(len(
                         optimizer.inner_optimizer.variables))],
                     "inner optimizer variable")


# The usual order, traced: compile, restore a plain checkpoint, then train;
# the optimizer is built by `fit` before it traces, or while `tf.function`
# traces the custom loop's first step.
@pytest.mark.parametrize("loop", ["traced_loop", "fit"])
@pytest.mark.parametrize("name", ["adafactor", "adam", "sgd_momentum"])
def test_plain_checkpoint_resumes_wrapped_in_traced_training(
        name, loop, saved_run, fresh_model):
    run = saved_run(name, "plain", loop)
    model = fresh_model(1, loop)
    optimizer = _optimizer(name, "wrapped")
    train = _trainer(model, optimizer, loop)

    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        run.checkpoint)
    train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))

    _assert_continues_as(model, optimizer, run.after_next)


# ---------------------------------------------------------------------------
# Across precisions: a float32 project moves to mixed_float16, and back.


def _precision_run(name, kind, policy, seed, fresh_model):
    keras.mixed_precision.set_global_policy(policy)
    model = fresh_model(seed, policy)
    optimizer = _optimizer(name, kind)
    return model, optimizer, _custom_loop(model, optimizer)


@pytest.fixture(scope="module")
def saved_in_other_precision(tmp_path_factory, fresh_model):
    """`(name, saved, restored) -> (checkpoint, (weights, optimizer state))`:
    a run saved as `saved` (kind, policy), and the step from its saved state
    set by hand as `restored`: the uninterrupted run in the new precision."""
    directory = tmp_path_factory.mktemp("precisions")

    @functools.cache
    def save(name, saved, restored):
        source, source_optimizer, train = _precision_run(
            name, *saved, seed=0, fresh_model=fresh_model)
        train(*training.normal_data(BATCH, STEPS_BEFORE_SAVE))
        path = tf.train.Checkpoint(
            model=source, optimizer=source_optimizer).write(
                str(directory / "_".join((name, *saved, *restored))))
        reference, reference_optimizer, reference_train = _precision_run(
            name, *restored, seed=1, fresh_model=fresh_model)
        reference_optimizer.build(reference.trainable_variables)
        for variable, value in zip(
                reference.weights + _inner(reference_optimizer).variables,
                source.weights + _inner(source_optimizer).variables,
                strict=True):
            variable.assign(value)
        reference_train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))
        return path, _snapshot(reference, reference_optimizer)

    return save


@pytest.mark.parametrize("build_first", [False, True],
                         ids=["restored_before_build", "restored_after_build"])
@pytest.mark.parametrize("saved, restored", [
    (("plain", "float32"), ("wrapped", "mixed_float16")),
    (("wrapped", "mixed_float16"), ("plain", "float32")),
], ids=["float32_plain_to_mixed_wrapped", "mixed_wrapped_to_float32_plain"])
@pytest.mark.parametrize("name", ["adafactor", "adam", "sgd_momentum"])
def test_next_step_across_precisions_is_the_one_from_the_saved_state(
        name, saved, restored, build_first, saved_in_other_precision,
        fresh_model):
    path, expected = saved_in_other_precision(name, saved, restored)
    model, optimizer, train = _precision_run(name, *restored, seed=2,
                                             fresh_model=fresh_model)
    if build_first:
        optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(
        path).expect_partial()
    train(*training.normal_data(BATCH, seed=STEPS_BEFORE_SAVE))

    _assert_continues_as(model, optimizer, expected)


# ---------------------------------------------------------------------------
# .keras files.


def _fit(model, steps, first):
    _fit_on(model, *training.normal_data(BATCH, steps, seed=first))


def _load_weights_warnings(model, path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(path)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("name", ["adafactor", "adam"])
def test_loaded_plain_optimizer_keeps_its_state_once_wrapped(
        name, saved_run):
    run = saved_run(name, "plain", "fit")
    model = keras.models.load_model(run.keras_file)

    model.compile(optimizer=LossScaleOptimizer(model.optimizer), loss="mse")
    _fit(model, 1, first=STEPS_BEFORE_SAVE)

    _assert_continues_as(model, model.optimizer, run.after_next)


@pytest.mark.parametrize("name", ["adafactor", "adam"])
def test_loaded_wrapper_hands_its_state_over_to_its_inner_optimizer(
        name, saved_run):
    run = saved_run(name, "wrapped", "fit")
    model = keras.models.load_model(run.keras_file)

    model.compile(optimizer=model.optimizer.inner_optimizer, loss="mse")
    _fit(model, 1, first=STEPS_BEFORE_SAVE)

    _assert_continues_as(model, model.optimizer, run.after_next)


@pytest.mark.parametrize("name", ["adafactor", "adam"])
def test_plain_keras_file_loads_into_a_built_wrapper(name, saved_run,
                                                    fresh_model):
    run = saved_run(name, "plain", "fit")
    model = fresh_model(1, "fit")
    model.compile(optimizer=_optimizer(name, "wrapped"), loss="mse")
    model.optimizer.build(model.trainable_variables)

    messages = _load_weights_warnings(model, run.keras_file)
    _fit(model, 1, first=STEPS_BEFORE_SAVE)

    # Nothing reported lost: the inner optimizer's own entry, which a plain
    # optimizer's file lacks, is not missed.
    assert not [m for m in messages if "Skipping" in m], messages
    _assert_continues_as(model, model.optimizer, run.after_next)


def test_plain_keras_file_gives_a_mixed_float16_model_its_state(
        saved_run, fresh_model):
    # The model rebuilt under the new policy, as the README describes.
    run = saved_run("adam", "plain", "fit")
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = fresh_model(1, "mixed_float16")
    model.compile(optimizer=_optimizer("adam", "wrapped"), loss="mse")
    model.optimizer.build(model.trainable_variables)

    messages = _load_weights_warnings(model, run.keras_file)

    assert not [m for m in messages if "Skipping" in m], messages
    weights, state = _snapshot(model, model.optimizer)
    _assert_same(weights, run.at_save[0], "weight")
    _assert_same(state, run.at_save[1], "optimizer variable")
    _fit(model, 1, first=STEPS_BEFORE_SAVE)
    assert int(model.optimizer.iterations) == STEPS_BEFORE_SAVE + 1


@pytest.mark.parametrize("saved_by, restored_into", [
    ("plain", "wrapped"), ("wrapped", "plain")],
    ids=["plain_file_into_unbuilt_wrapper", "wrapped_file_into_plain"])
def test_optimizer_state_that_cannot_be_loaded_is_reported(
        saved_by, restored_into, saved_run, fresh_model):
    run = saved_run("adam", saved_by, "fit")
    model = fresh_model(1, "fit")
    optimizer = _optimizer("adam", restored_into)
    model.compile(optimizer=optimizer, loss="mse")
    if restored_into == "plain":
        # Built, yet the wrapper's file does not fit a plain optimizer.
        optimizer.build(model.trainable_variables)
    state_before = _state_of(optimizer)

    messages = _load_weights_warnings(model, run.keras_file)

    assert any(f"Skipping variable loading for optimizer '{optimizer.name}'"
               in message for message in messages), messages
    _assert_same(_state_of(optimizer), state_before, "optimizer variable")
