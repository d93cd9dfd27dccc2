"""`LossScaleOptimizer` for tf-keras (Keras 2) optimizers.

Imported only when a tf-keras optimizer is wrapped:
`tf_lossscale.LossScaleOptimizer(tf.keras.optimizers.Adam())` with
`TF_USE_LEGACY_KERAS=1`, or with a `tf_keras` optimizer, returns one of the two
classes here (the Keras 3 class dispatches in `__new__`):

* `LossScaleOptimizer` for `tf_keras.optimizers.*` (tf-keras' Optimizer of
  2.11+), a subclass of tf-keras' own `LossScaleOptimizerV3`;
* `LegacyLossScaleOptimizer` for `tf_keras.optimizers.legacy.*`
  (`OptimizerV2`), a subclass of tf-keras' own V2 `LossScaleOptimizer`.

Both are therefore instances of `tf.keras.mixed_precision.LossScaleOptimizer`:
tf-keras' `compile` under `mixed_float16` keeps them (it wraps any optimizer
that is not one), and trainers that test for that class (TF Model Garden's)
take the loss-scaling path. From tf-keras' classes they keep only the
delegation to the inner optimizer (`iterations`, `learning_rate`, the legacy
class's hyperparameters, `minimize`, `compute_gradients`); the step is
tf_lossscale's (`tf_lossscale.step.loss_scaled_step`), so unlike tf-keras':

* a skipped step leaves weights, slots *and* `iterations` untouched, and is
  counted in `skipped_steps`, with `last_nonfinite_variables()`;
* any `tf_lossscale` loss scale, fixed scales that skip included;
* one agreed decision across replicas and workers before any collective.

What tf-keras users' code relies on is as with tf-keras' wrapper: the
gradients are aggregated across replicas first, by the inner optimizer's
own aggregation (a custom `gradient_aggregator` included), and the aggregate
is checked and applied; the inner `apply_gradients` gets tf-keras' arguments;
gradients of a loss never scaled are applied as given, with tf-keras'
warning; refused arguments raise tf-keras' exception types and phrases
(`tf_lossscale.tf_keras.arguments`); TF 2.2 checkpoints restore their slots.
What still differs, and why: docs/guides/tf-keras.md.

State and formats, as tf-keras' wrapper has them: checkpoint dependencies are
the inner optimizer's plus `loss_scale` (and `skipped_steps`), so checkpoints
of tf-keras' wrapper restore into this one and back; `variables` (and the
legacy `weights`) are the inner optimizer's, then the loss scale's, then the
wrapper's own, which `.h5` files and `.keras` files store; configs are
`{"name", "inner_optimizer", "loss_scale"}`, and tf-keras' own
(`dynamic`, `initial_scale`, `dynamic_growth_steps`) load too.
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
from tf_lossscale._internal import versions

# Before tf_keras' internals below are reached: an older tf-keras than
# supported fails here with an ImportError that says what to install; a newer
# one than tested gets a warning (unless `import tf_lossscale` gave it).
versions.warn_untested([versions.check(versions.TF_KERAS)])

import tensorflow as tf
import tf_keras

from tf_lossscale.step import legacy_configs
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.step import optimizer_arguments
from tf_lossscale.step import optimizer_protocol
from tf_lossscale._internal import private_api
from tf_lossscale._internal import step_arguments
from tf_lossscale.tf_keras import arguments
from tf_lossscale.step import wrapper_core
from tf_lossscale.loss_scales import xla_checks
# pylint: enable=g-import-not-at-top,wrong-import-position

_tf_keras_lso = private_api.tf_keras_loss_scale_optimizers()

_NEW_BASE = tf_keras.optimizers.Optimizer
_LEGACY_BASE = tf_keras.optimizers.legacy.Optimizer


def wrap(inner_optimizer, *args, **kwargs):
    """The tf-keras wrapper class for `inner_optimizer`, constructed with
    the arguments of `tf_lossscale.LossScaleOptimizer`. Anything but a
    tf-keras optimizer is refused as tf-keras refuses it."""
    arguments.check_inner(inner_optimizer, (_NEW_BASE, _LEGACY_BASE),
                                   _tf_keras_lso.BaseLossScaleOptimizer)
    if isinstance(inner_optimizer, _LEGACY_BASE):
        return LegacyLossScaleOptimizer(inner_optimizer, *args, **kwargs)
    return LossScaleOptimizer(inner_optimizer, *args, **kwargs)


def _track_tf22_slot_placeholder(wrapper, inner_optimizer):
    """Lets TF 2.2 checkpoints of tf-keras' wrapper restore the slots.

    TF 2.2's wrapper saved its inner optimizer (and so its slots) under
    `base_optimizer`; tf-keras tracks a placeholder there that hands those
    slots to the inner optimizer, and so does this wrapper. It holds no
    variable, so checkpoints written now are unchanged but for the empty
    entry tf-keras' wrapper writes too.
    """
    # Tracked on the inner optimizer, as everything the wrapper tracks.
    private_api.track(
        wrapper,
        _tf_keras_lso.FakeOptimizerForRestoration(inner_optimizer),
        "base_optimizer")


# One key for a variable, whichever replica's component is at hand.
_key = private_api.variable_key


class _TfKerasWrapper(optimizer_protocol.ScaledLossProtocol):
    """What both tf-keras wrapper classes add to tf-keras' own wrappers.

    Args and Raises: as `tf_lossscale.LossScaleOptimizer`; `inner_optimizer`
    is a tf-keras optimizer of the class's kind.
    """

    _INNER_BASE = None  # The inner optimizers' base class.

    def __init__(self, inner_optimizer, loss_scale="dynamic", name=None, *,
                 initial_scale=None, dynamic_growth_steps=None, dynamic=None,
                 **kwargs):
        arguments.check_inner(inner_optimizer, self._INNER_BASE,
                                       _tf_keras_lso.BaseLossScaleOptimizer)
        optimizer_arguments.check_name(name)
        optimizer_arguments.check_base_optimizer_kwargs(kwargs)
        arguments.check_keras_style_arguments(
            dynamic, initial_scale, dynamic_growth_steps)
        arguments.check_strategy()
        resolved = optimizer_arguments.resolve_loss_scale(
            loss_scale, dynamic, initial_scale, dynamic_growth_steps)
        # First: the legacy class's __setattr__ reads the inner optimizer.
        self._optimizer = inner_optimizer
        private_api.tf_keras_mark_wrapped(inner_optimizer)
        optimizer_arguments.claim(inner_optimizer, self)
        # As in tf-keras' wrapper, checkpoint dependencies are the inner
        # optimizer's: tracking below lands there, so both wrappers' checkpoints
        # have one layout and restore into each other.
        private_api.DelegatingTrackableMixin.__init__(
            self, inner_optimizer)
        self.name = name or "LossScaleOptimizer"
        self._loss_scale = resolved
        private_api.track(self, resolved, "loss_scale")
        with tf.init_scope():
            self._skipped_steps = tf.Variable(
                0, name="skipped_steps", dtype=tf.int64, trainable=False,
                aggregation=tf.VariableAggregation.NONE)
        private_api.track(self, self._skipped_steps, "skipped_steps")
        # Created with the inner optimizer's slots (`_build`).
        self._last_nonfinite = None
        self._built_for = []
        self._reset_protocol()

    # State.

    def _build(self, var_list):
        """Builds the inner optimizer and the per-variable overflow flags."""
        var_list = list(var_list)
        with loss_scaled_step.building_outside_traces():
            self._build_inner(var_list)
        if self._last_nonfinite is None:
            with loss_scaled_step.building_outside_traces():
                # One flag per variable, written only on skipped steps.
                flags = tf.Variable(
                    tf.zeros([len(var_list)], tf.int32),
                    name="last_nonfinite", trainable=False,
                    aggregation=tf.VariableAggregation.NONE)
            # Past automatic tracking, which would make them checkpoint
            # dependencies of the inner optimizer (see __init__).
            object.__setattr__(self, "_last_nonfinite", flags)
            object.__setattr__(self, "_built_for", var_list)

    def _all_variables(self):
        """The inner optimizer's variables, the scale's, then the wrapper's."""
        own = [self._skipped_steps]
        if self._last_nonfinite is not None:
            own.append(self._last_nonfinite)
        return (list(self._inner_variables()) + list(self._loss_scale.variables)
                + own)

    def get_weights(self):
        return [variable.numpy() for variable in self._all_variables()]

    def set_weights(self, weights):
        """Sets every variable of `variables`, in that order (.h5 files);
        nothing if the loss scale's values cannot be assigned exactly
        (`LossScale.check_loadable` raises first)."""
        variables = self._all_variables()
        if len(weights) != len(variables):
            raise ValueError(
                f"LossScaleOptimizer has {len(variables)} variables, got "
                f"{len(weights)} values: build it first with "
                "optimizer.build(model.trainable_variables)")
        first = len(self._inner_variables())
        self._loss_scale.check_loadable(
            weights[first:first + len(self._loss_scale.variables)])
        for variable, value in zip(variables, weights):
            variable.assign(value)

    def save_own_variables(self, store):
        """`.keras` files: the values of `variables`, under "0", "1", ..."""
        for index, value in enumerate(self.get_weights()):
            store[str(index)] = value

    def load_own_variables(self, store):
        """Restores `save_own_variables`; an optimizer not built like the
        saved one is left untouched (as tf-keras does), scale included."""
        if len(store.keys()) != len(self._all_variables()):
            tf.get_logger().warning(
                f"Skipping variable loading for optimizer '{self.name}': it "
                f"has {len(self._all_variables())} variables, the saved one "
                f"{len(store.keys())}. Build it first.")
            return
        self.set_weights([store[str(i)] for i in range(len(store.keys()))])

    def last_nonfinite_variables(self):
        """Paths of the variables whose gradients held NaN or +-Inf on the
        most recent skipped step, on any replica or worker, in the order the
        optimizer was built with; `[]` before the first skipped step.

        A path is the variable's name without its `:0` suffix
        (`"dense/kernel"`), as the Keras 3 wrapper returns `variable.path`:
        the same strings for the same functional model
        (`tf_lossscale.step.wrapper_core.nonfinite_paths`). Before 0.4 these were
        the names, `"dense/kernel:0"`.
        """
        return wrapper_core.nonfinite_paths(self._built_for,
                                            self._last_nonfinite)

    # Applying.

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Applies the gradients unless the step's are not all finite.

        Gradients are unscaled (TF 2.x protocol: `get_unscaled_gradients`,
        as `fit` and `minimize` do), or scaled after `scale_loss`. Those of
        a loss that was never scaled are applied as given, with tf-keras'
        warning. Must be called in a replica context: else
        `checks.ReplicaContextError` (a ValueError and a RuntimeError). As in tf-keras, the
        gradients are aggregated across replicas first (the inner
        optimizer's aggregation, custom `gradient_aggregator` included) and
        the aggregate is what is checked and applied; `kwargs` are the inner
        optimizer's (`experimental_aggregate_gradients`,
        `skip_gradients_aggregation`).
        """
        self.check_unscaled()
        wrapper_core.open_step(arguments.check_strategy)
        loss_scaled_step.check_traceable(self._loss_scale)
        arguments.warn_if_not_scaled(
            self._loss_scaled, self._caller_unscales)
        # Refused pairs raise here, before anything changes (at least one
        # gradient is there after the check).
        grads, variables = step_arguments.checked_pairs(grads_and_vars)
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        pairs = self._aggregate(pairs, **kwargs)
        grads, variables = (list(part) for part in zip(*pairs))
        self._build(variables)
        if self._loss_scaled and not self._caller_unscales:
            grads = loss_scaled_step.unscale_for_apply(
                grads, variables, self._loss_scale())

        def apply_fn(grads, variables):
            return self._apply_aggregated(list(zip(grads, variables)), name)

        step = loss_scaled_step.apply_or_skip(
            self._loss_scale, grads, variables, apply_fn, self._skip_record(),
            stats=self._stats_for(variables))
        return self.iterations if step is None else step

    def _skip_record(self):
        positions = {_key(v): i for i, v in enumerate(self._built_for)}
        return wrapper_core.skip_record(
            self._skipped_steps, self._last_nonfinite, self._built_for,
            lambda v: positions[_key(v)])

    # Configs.

    def get_config(self):
        return optimizer_protocol.wrapper_config(
            self, tf_keras.optimizers.serialize(self._optimizer))

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates the wrapper from its config or tf-keras' wrapper's."""
        inner_config, kwargs = legacy_configs.split_inner_optimizer(
            config, custom_objects, optimizer_types=(_NEW_BASE, _LEGACY_BASE))
        inner = inner_config
        if not isinstance(inner, (_NEW_BASE, _LEGACY_BASE)):
            inner = tf_keras.optimizers.deserialize(
                inner_config, custom_objects=custom_objects,
                use_legacy_optimizer=cls._INNER_BASE is _LEGACY_BASE)
        return wrap(inner, **kwargs)


@tf_keras.saving.register_keras_serializable(package="tf_lossscale",
                                             name="LossScaleOptimizer")
class LossScaleOptimizer(_TfKerasWrapper, _tf_keras_lso.LossScaleOptimizerV3):
    """Wraps a `tf_keras.optimizers.Optimizer`; see the module docstring."""

    _INNER_BASE = _NEW_BASE

    # Keras' automatic tracking would reach the inner optimizer before the
    # constructor has attached it.
    @private_api.no_automatic_dependency_tracking
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def _build_inner(self, var_list):
        with tf.init_scope():
            self._optimizer.build(var_list)

    def _aggregate(self, pairs, skip_gradients_aggregation=False,
                   experimental_aggregate_gradients=True):
        """The inner optimizer's all-replica aggregate of `pairs` (its public
        `aggregate_gradients`), unless the caller aggregated them."""
        if skip_gradients_aggregation or not experimental_aggregate_gradients:
            return pairs
        return list(self._optimizer.aggregate_gradients(pairs))

    def _apply_aggregated(self, pairs, name):
        # As tf-keras' wrapper calls it: no `name`, which a subclass's
        # apply_gradients may not take.
        del name
        return self._optimizer.apply_gradients(
            pairs, skip_gradients_aggregation=True)

    def _inner_variables(self):
        return self._optimizer.variables

    def build(self, var_list):
        self._build(var_list)

    def finalize_variable_values(self, var_list):
        """tf-keras' wrapper's; first, at the end of `fit`, raises what XLA
        steps left to the host (`tf_lossscale.loss_scales.xla_checks`). tf-keras' `fit`
        calls it for this class only, not for the legacy one."""
        xla_checks.act(self)
        super().finalize_variable_values(var_list)

    @property
    def variables(self):
        """See `_all_variables`."""
        return self._all_variables()


@tf_keras.saving.register_keras_serializable(
    package="tf_lossscale", name="LegacyLossScaleOptimizer")
class LegacyLossScaleOptimizer(_TfKerasWrapper,
                               _tf_keras_lso.LossScaleOptimizer):
    """Wraps a `tf_keras.optimizers.legacy.Optimizer` (OptimizerV2); see the
    module docstring."""

    _INNER_BASE = _LEGACY_BASE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _track_tf22_slot_placeholder(self, self._optimizer)

    def _build_inner(self, var_list):
        with tf.init_scope():
            private_api.tf_keras_create_all_weights(self._optimizer, var_list)

    def apply_gradients(self, grads_and_vars, name=None,
                        experimental_aggregate_gradients=True):
        """`_TfKerasWrapper.apply_gradients`, with `OptimizerV2`'s
        signature."""
        # Not super(): autograph converts this method inside a tf.function,
        # and a zero-argument super() does not survive the conversion.
        return _TfKerasWrapper.apply_gradients(
            self, grads_and_vars, name,
            experimental_aggregate_gradients=experimental_aggregate_gradients)

    def _aggregate(self, pairs, experimental_aggregate_gradients=True):
        """The inner optimizer's all-replica aggregate of `pairs` (its
        `gradient_aggregator`), unless the caller aggregated them."""
        if not experimental_aggregate_gradients:
            return pairs
        return list(private_api.tf_keras_aggregate_legacy(self._optimizer,
                                                          pairs))

    def _apply_aggregated(self, pairs, name):
        # As tf-keras' wrapper calls it.
        return self._optimizer.apply_gradients(
            pairs, name=name, experimental_aggregate_gradients=False)

    def _inner_variables(self):
        return self._optimizer.variables()

    def _create_all_weights(self, var_list):
        self._build(var_list)

    def variables(self):
        """See `_all_variables`."""
        return self._all_variables()

    @property
    def weights(self):
        return self._all_variables()


# What `isinstance(opt, tf_lossscale.LossScaleOptimizer)` also accepts.
WRAPPER_CLASSES = (LossScaleOptimizer, LegacyLossScaleOptimizer)
