"""A loss-scale state that cannot be right stops training instead of hiding.

Without a check, a restored or assigned scale of NaN makes every later step
skip forever, 0 silently resets to the floor and a negative scale trains with
a negative multiplier. tf_lossscale refuses such a state at the first update:
an InvalidArgumentError names the value, and no variable (the loss scale's,
the weights, the optimizer's) changes. Under XLA the step is refused (nothing
changes) and the host raises the same error after the call.

A refused update or step changes nothing, so the cases share their set-ups:
one loss scale and one traced update per mode and rule, one trained model
per fit mode, each set back to its state before every case.
"""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import models
from tests.helpers.training import values_of
import tf_lossscale

# One xdist worker runs the file, so each shared set-up is made once.
pytestmark = pytest.mark.xdist_group("scale_state_checks")

_NAN = float("nan")
_INF = float("inf")

_BAD_SCALES = {"nan": _NAN, "inf": _INF, "-inf": -_INF, "zero": 0.0,
               "negative": -4.0}
_RULES = {
    "defaults": {},
    "all_features": dict(initial_loss_scale=8, hysteresis=3,
                         on_min_loss_scale="raise", max_consecutive_skips=4),
}


def _assert_unchanged(variables, before):
    for variable, value in zip(variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def _reported_scale(message):
    """The value the message gives for current_loss_scale."""
    match = re.search(
        r"current_loss_scale[\s=\[\]]+(-?(?:nan|inf|\d[\d.e+-]*))", message)
    assert match, message
    return float(match.group(1))


def _update_in(mode, loss_scale):
    """`update(grad) -> should_apply`: `loss_scale.update([grad])` eagerly,
    traced, or compiled by XLA (its checks run on the host after the call)."""
    if mode == "eager":
        return lambda grad: loss_scale.update([grad])[1]
    step = tf.function(lambda grad: loss_scale.update([grad])[1],
                       jit_compile=mode == "xla")
    if mode == "xla":
        step = tf_lossscale.with_xla_checks(step, loss_scale)
    return step


@pytest.fixture(scope="module")
def fresh_loss_scale():
    """`(mode, **rule) -> (loss_scale, update)`: `DynamicLossScale(**rule)`
    with the values it was made with, and its `_update_in(mode)`. One loss
    scale per mode and rule, set back at each call, so that its update is
    traced (and compiled) once, not at every case."""
    made = {}

    def fresh(mode, **rule):
        key = mode, tuple(sorted(rule.items()))
        if key not in made:
            loss_scale = tf_lossscale.DynamicLossScale(**rule)
            made[key] = (loss_scale, _update_in(mode, loss_scale),
                         values_of(loss_scale.variables))
        loss_scale, update, initial = made[key]
        for variable, value in zip(loss_scale.variables, initial,
                                   strict=True):
            variable.assign(value)
        return loss_scale, update

    return fresh


_MODES = ["eager", "tf_function", "xla"]


@pytest.mark.parametrize("rule", _RULES)
@pytest.mark.parametrize("bad", _BAD_SCALES)
@pytest.mark.parametrize("mode", _MODES)
def test_assigned_bad_scale_fails_the_next_update_naming_it(
        mode, bad, rule, fresh_loss_scale):
    loss_scale, update = fresh_loss_scale(mode, **_RULES[rule])
    loss_scale.update([tf.constant(1.0)])
    loss_scale.variables[0].assign(_BAD_SCALES[bad])
    before = values_of(loss_scale.variables)
    for finite in (True, False):
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            update(tf.constant(1.0 if finite else _NAN))
        reported = _reported_scale(str(raised.value))
        np.testing.assert_array_equal(reported, _BAD_SCALES[bad])
        _assert_unchanged(loss_scale.variables, before)


@pytest.mark.parametrize("mode", _MODES)
def test_negative_good_steps_fail_the_next_update_naming_them(
        mode, fresh_loss_scale):
    loss_scale, update = fresh_loss_scale(mode, initial_loss_scale=8)
    loss_scale.variables[1].assign(-3)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"good_steps\W+-3"):
        update(tf.constant(1.0))
    assert values_of(loss_scale.variables) == [8.0, -3]


def _tf1_fetches_that_update(loss_scale, grads, caller):
    """What a Session runs to take a step, per caller of the loss scale."""
    if caller == "update":
        # Its should_apply comes from the gradients alone in a TF1 graph
        # (test_tf1_should_apply_from_gradients.py): update_op takes the step.
        update_op, should_apply = loss_scale.update([grads])
        return update_op, [update_op, should_apply]
    # What LossScaleOptimizer calls: its should_apply is gated on the step.
    update_op, should_apply = loss_scale._update_from_all_finite(  # pylint: disable=protected-access
        tf.math.is_finite(grads))
    return update_op, should_apply


@pytest.mark.parametrize("caller", ["update", "optimizer"])
def test_bad_state_fails_in_tf1_session_without_changing_variables(caller):
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                                   hysteresis=2)
        grads = tf.compat.v1.placeholder(tf.float32, [])
        fetches = _tf1_fetches_that_update(loss_scale, grads, caller)
        scale_variable = loss_scale.variables[0]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(scale_variable.assign(_NAN))
            before = session.run(list(loss_scale.variables))
            for fetch in fetches:
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match="current_loss_scale"):
                    session.run(fetch, {grads: 1.0})
            after = session.run(list(loss_scale.variables))
    np.testing.assert_array_equal(np.array(after, dtype=object)[1:],
                                  np.array(before, dtype=object)[1:])
    assert np.isnan(after[0])


def test_branch_on_update_in_tf_function_waits_for_the_state_check():
    # A negative scale leaves finite gradients finite, so should_apply is
    # True; inside a tf.function it is gated on the check, so neither branch
    # of a tf.cond on it runs before the step fails.
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
    loss_scale.variables[0].assign(-4.0)
    applied = tf.Variable(0)
    skipped = tf.Variable(0)

    @tf.function
    def step(grad):
        _, should_apply = loss_scale.update([grad])
        tf.cond(should_apply, lambda: applied.assign_add(1),
                lambda: skipped.assign_add(1))

    with pytest.raises(tf.errors.InvalidArgumentError, match="-4"):
        step(tf.constant(1.0))
    assert (int(applied.numpy()), int(skipped.numpy())) == (0, 0)


def test_valid_extremes_pass_the_check():
    # A subnormal scale is valid (TensorFlow's reference accepts it), even
    # where the CPU flushes subnormals to zero in comparisons.
    for scale in (float(np.finfo(np.float32).tiny) / 4, 1e-30,
                  float(np.finfo(np.float32).max)):
        loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
        loss_scale.variables[0].assign(scale)
        _, should_apply = loss_scale.update([tf.constant(1.0)])
        assert bool(should_apply)


@pytest.mark.parametrize("mode", _MODES)
def test_checkpoint_with_nan_scale_fails_at_the_first_step_after_restore(
        mode, tmp_path, fresh_loss_scale):
    saved = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                          max_consecutive_skips=3)
    saved.variables[0].assign(_NAN)
    path = tf.train.Checkpoint(loss_scale=saved).write(
        os.path.join(tmp_path, "ckpt"))

    restored, update = fresh_loss_scale(mode, initial_loss_scale=8,
                                        max_consecutive_skips=3)
    tf.train.Checkpoint(loss_scale=restored).read(path).assert_consumed()
    before = values_of(restored.variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match="nan"):
        update(tf.constant(1.0))
    _assert_unchanged(restored.variables, before)


# ---------------------------------------------------------------------------
# Keras: the step fails before any weight or slot moves.


_FIT_MODES = {
    "eager": dict(run_eagerly=True),
    "tf_function": dict(jit_compile=False),
    "xla": dict(jit_compile=True),
    "xla_2_steps_per_call": dict(jit_compile=True, steps_per_execution=2),
}


def _compiled_model(compile_args=None):
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9),
        loss_scale=tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                                 hysteresis=2))
    model.compile(optimizer, "mse", **(compile_args or {}))
    return model, optimizer


def _fit(model, batches=1):
    # The same batch `batches` times, as a dataset: fit's own slicing of
    # numpy arrays traces three functions at every call.
    x, y = (np.tile(a, (batches, 1)) for a in training.normal_data(8))
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1,
              shuffle=False, verbose=0,
              callbacks=[tf_lossscale.XlaChecks()])


def _all_state(model, optimizer):
    return (model.weights + optimizer.inner_optimizer.variables
            + list(optimizer.loss_scale.variables))


@pytest.fixture(scope="module")
def trained_model():
    """`(make, mode) -> (model, optimizer)`: `make(_FIT_MODES[mode])`, built
    under the global policy and trained one batch with `_fit`, set back to
    that state at each call. One per maker, mode and policy: its step is
    traced (and compiled) once, not at every case."""
    made = {}

    def trained(make, mode):
        key = make, mode, keras.mixed_precision.global_policy().name
        if key not in made:
            model, optimizer = make(_FIT_MODES[mode])
            _fit(model)
            state = model.weights + optimizer.variables
            made[key] = model, optimizer, state, values_of(state)
        model, optimizer, state, values = made[key]
        for variable, value in zip(state, values, strict=True):
            variable.assign(value)
        return model, optimizer

    return trained


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("bad", ["nan", "negative", "zero"])
@pytest.mark.parametrize("mode", _FIT_MODES)
def test_fit_with_an_assigned_bad_scale_fails_and_changes_nothing(
        mode, bad, trained_model):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, optimizer = trained_model(_compiled_model, mode)
    optimizer.loss_scale.variables[0].assign(_BAD_SCALES[bad])
    state = _all_state(model, optimizer) + [optimizer.skipped_steps]
    before = values_of(state)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="current_loss_scale"):
        _fit(model, batches=4)
    _assert_unchanged(state, before)
    assert int(optimizer.iterations.numpy()) == 1


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("xla", [False, True], ids=["tf_function", "xla"])
def test_keras_file_holding_a_nan_scale_fails_at_the_first_step(
        tmp_path, xla, trained_model):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, optimizer = trained_model(_compiled_model, "tf_function")
    optimizer.loss_scale.variables[0].assign(_NAN)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)

    loaded = keras.models.load_model(path)
    loaded.compile(loaded.optimizer, "mse", jit_compile=xla)
    loaded_optimizer = loaded.optimizer
    assert np.isnan(loaded_optimizer.loss_scale().numpy())
    state = _all_state(loaded, loaded_optimizer)
    before = values_of(state)
    with pytest.raises(tf.errors.InvalidArgumentError, match="nan"):
        _fit(loaded)
    _assert_unchanged(state, before)


# ---------------------------------------------------------------------------
# Every counter: hysteresis_remaining in [0, hysteresis], consecutive_skips
# and good_steps >= 0, on every path; the message names every field.


_COUNTING_RULE = dict(initial_loss_scale=8, increment_period=5, hysteresis=3,
                      max_consecutive_skips=4)
_BAD_COUNTERS = {
    "budget_negative": ("hysteresis_remaining", -1),
    "budget_above_hysteresis": ("hysteresis_remaining", 4),
    "skips_negative": ("consecutive_skips", -1),
    "good_steps_negative": ("good_steps", -2),
}


def _by_name(loss_scale):
    return {re.sub(r"(_\d+)?:\d+$", "", v.name): v
            for v in loss_scale.variables}


def _names_every_field(message, bad_field, bad_value):
    # Eagerly and under XLA "name=value"; a graph's assertion prints
    # "[name =] [value]".
    for field in ("current_loss_scale", "good_steps", "hysteresis_remaining",
                  "consecutive_skips"):
        assert re.search(rf"{field}[\s=\[\]]+-?\d", message), (field, message)
    assert re.search(rf"{bad_field}[\s=\[\]]+{bad_value}\b", message), message


@pytest.mark.parametrize("bad", _BAD_COUNTERS)
@pytest.mark.parametrize("mode", _MODES)
def test_assigned_bad_counter_fails_the_next_update_naming_every_field(
        mode, bad, fresh_loss_scale):
    field, value = _BAD_COUNTERS[bad]
    loss_scale, update = fresh_loss_scale(mode, **_COUNTING_RULE)
    loss_scale.update([tf.constant(1.0)])
    _by_name(loss_scale)[field].assign(value)
    before = values_of(loss_scale.variables)
    for finite in (True, False):
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            update(tf.constant(1.0 if finite else _NAN))
        _names_every_field(str(raised.value), field, value)
        _assert_unchanged(loss_scale.variables, before)


@pytest.mark.parametrize("bad", _BAD_COUNTERS)
def test_bad_counter_fails_in_tf1_session_without_changing_variables(bad):
    field, value = _BAD_COUNTERS[bad]
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.DynamicLossScale(**_COUNTING_RULE)
        grads = tf.compat.v1.placeholder(tf.float32, [])
        update_op, _ = loss_scale.update([grads])
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(_by_name(loss_scale)[field].assign(value))
            before = session.run(list(loss_scale.variables))
            with pytest.raises(tf.errors.InvalidArgumentError) as raised:
                session.run(update_op, {grads: 1.0})
            after = session.run(list(loss_scale.variables))
    _names_every_field(str(raised.value), field, value)
    assert after == before


@pytest.mark.parametrize("mode", _MODES)
def test_counters_the_rule_can_reach_pass_the_check(mode, fresh_loss_scale):
    # H at 0 and at hysteresis, C past max_consecutive_skips (training may be
    # resumed after that error), G past increment_period (TensorFlow's rule
    # grows at the next finite step).
    for field, value in [("hysteresis_remaining", 0),
                         ("hysteresis_remaining", 3),
                         ("consecutive_skips", 9), ("good_steps", 5000)]:
        loss_scale, update = fresh_loss_scale(mode, **_COUNTING_RULE)
        _by_name(loss_scale)[field].assign(value)
        assert bool(update(tf.constant(1.0))), (field, value)


def test_good_steps_past_the_period_grow_at_the_next_step_as_in_tensorflow(
        tmp_path):
    # A checkpoint written with another increment_period: TensorFlow's rule
    # grows at the next finite step, and so does ours.
    saved = tf_lossscale.DynamicLossScale(8, increment_period=50)
    _by_name(saved)["good_steps"].assign(12)
    path = tf.train.Checkpoint(loss_scale=saved).write(
        os.path.join(tmp_path, "ckpt"))
    ours = tf_lossscale.DynamicLossScale(8, increment_period=5)
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(
        8, increment_period=5)
    for index, loss_scale in enumerate((ours, reference)):
        checkpoint = tf.train.Checkpoint(loss_scale=loss_scale)
        checkpoint.read(path).assert_consumed()
        loss_scale.update([tf.constant(1.0)])
        checkpoint.write(os.path.join(tmp_path, f"after_{index}"))
    assert float(ours()) == float(reference()) == 16.0
    good_steps = [tf.train.load_variable(
        os.path.join(tmp_path, f"after_{index}"),
        "loss_scale/good_steps/.ATTRIBUTES/VARIABLE_VALUE") for index in (0, 1)]
    assert good_steps[0] == good_steps[1] == 0


@pytest.mark.parametrize("bad", ["budget_negative", "skips_negative"])
@pytest.mark.parametrize("mode", _MODES)
def test_checkpoint_with_a_bad_counter_fails_at_the_first_step(
        mode, bad, tmp_path, fresh_loss_scale):
    field, value = _BAD_COUNTERS[bad]
    saved = tf_lossscale.DynamicLossScale(**_COUNTING_RULE)
    _by_name(saved)[field].assign(value)
    path = tf.train.Checkpoint(loss_scale=saved).write(
        os.path.join(tmp_path, "ckpt"))

    restored, update = fresh_loss_scale(mode, **_COUNTING_RULE)
    tf.train.Checkpoint(loss_scale=restored).read(path).assert_consumed()
    assert int(_by_name(restored)[field].numpy()) == value
    before = values_of(restored.variables)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        update(tf.constant(_NAN))
    _names_every_field(str(raised.value), field, value)
    _assert_unchanged(restored.variables, before)


def _counting_model(compile_args=None):
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9),
        loss_scale=tf_lossscale.DynamicLossScale(**_COUNTING_RULE))
    model.compile(optimizer, "mse", **(compile_args or {}))
    return model, optimizer


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("bad", ["budget_negative", "skips_negative"])
@pytest.mark.parametrize("xla", [False, True], ids=["tf_function", "xla"])
def test_keras_file_with_a_bad_counter_fails_at_the_first_step(
        tmp_path, xla, bad, trained_model):
    field, value = _BAD_COUNTERS[bad]
    model, optimizer = trained_model(_counting_model, "tf_function")
    _by_name(optimizer.loss_scale)[field].assign(value)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)

    loaded = keras.models.load_model(path)
    loaded.compile(loaded.optimizer, "mse", jit_compile=xla)
    assert int(_by_name(loaded.optimizer.loss_scale)[field].numpy()) == value
    state = _all_state(loaded, loaded.optimizer)
    before = values_of(state)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        _fit(loaded)
    _names_every_field(str(raised.value), field, value)
    _assert_unchanged(state, before)


def _rewritten(path, h5_path, value, tmp_path):
    """A copy of the .keras file at `path` whose weights hold `value` at
    `h5_path` (a crafted or damaged file)."""
    import h5py  # pylint: disable=g-import-not-at-top
    import zipfile  # pylint: disable=g-import-not-at-top

    weights = os.path.join(tmp_path, "model.weights.h5")
    with zipfile.ZipFile(path) as original:
        original.extract("model.weights.h5", tmp_path)
        names = [n for n in original.namelist() if n != "model.weights.h5"]
        others = {n: original.read(n) for n in names}
    with h5py.File(weights, "r+") as store:
        del store[h5_path]
        store[h5_path] = value
    crafted = os.path.join(tmp_path, "crafted.keras")
    with zipfile.ZipFile(crafted, "w") as copy:
        for name, content in others.items():
            copy.writestr(name, content)
        copy.write(weights, "model.weights.h5")
    return crafted


_UNHOLDABLE = {
    "good_steps_fraction": (1, "good_steps", np.float64(1.5), "1.5"),
    "good_steps_nan": (1, "good_steps", np.float64(_NAN), "nan"),
    "good_steps_huge": (1, "good_steps", np.float64(1e30), "1e+30"),
    "skips_fraction": (3, "consecutive_skips", np.float32(0.5), "0.5"),
    "budget_vector": (2, "hysteresis_remaining", np.arange(3),
                      "shape (3,)"),
    "scale_text": (0, "current_loss_scale", np.bytes_(b"8"), "b'8'"),
}


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("case", _UNHOLDABLE)
def test_keras_file_value_a_variable_cannot_hold_is_refused_at_load(
        tmp_path, case, trained_model):
    index, field, value, shown = _UNHOLDABLE[case]
    model, optimizer = trained_model(_counting_model, "tf_function")
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    crafted = _rewritten(path, f"optimizer/vars/loss_scale.{index}", value,
                         tmp_path)

    # Keras reports what a saveable raised as a ValueError that quotes it.
    with pytest.raises(ValueError) as raised:
        keras.models.load_model(crafted)
    message = str(raised.value)
    assert f"loss scale's {field} in this file cannot be loaded" in message
    assert shown in message

    # Into a model that trains on: the optimizer's variables stay as they
    # were (weights, slots, the loss scale's state).
    state = optimizer.variables
    before = values_of(state)
    with pytest.raises(ValueError, match=f"loss scale's {field}"):
        model.load_weights(crafted)
    _assert_unchanged(state, before)
