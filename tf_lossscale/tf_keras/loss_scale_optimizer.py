"""`LossScaleOptimizer` for tf-keras (Keras 2) optimizers, both kinds:
subclasses of tf-keras' own wrappers (docs/guides/tf-keras.md)."""

# pylint: disable=g-import-not-at-top,wrong-import-position
from tf_lossscale._internal import versions

# Before tf_keras is imported: an unsupported tf-keras fails with an
# ImportError that says what to install, an untested one warns.
versions.warn_untested([versions.check(versions.TF_KERAS)])

import tensorflow as tf
import tf_keras

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.loss_scales import xla_checks
from tf_lossscale.ops import replicas
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.step import optimizer_arguments
from tf_lossscale.step import optimizer_protocol
# pylint: enable=g-import-not-at-top,wrong-import-position

_tf_keras_lso = private_api.tf_keras_loss_scale_optimizers()
_NEW_BASE = tf_keras.optimizers.Optimizer
_LEGACY_BASE = tf_keras.optimizers.legacy.Optimizer


def wrap(inner_optimizer, *args, **kwargs):
    """`tf_lossscale.LossScaleOptimizer(inner_optimizer, ...)`, of its kind."""
    if isinstance(inner_optimizer, _LEGACY_BASE):
        return LegacyLossScaleOptimizer(inner_optimizer, *args, **kwargs)
    return LossScaleOptimizer(inner_optimizer, *args, **kwargs)


def _check_strategy():
    """`replicas.check_supported`, in tf-keras' words too."""
    try:
        replicas.check_supported()
    except ValueError as error:
        raise ValueError(
            "Loss scaling is not supported with the tf.distribute.Strategy: "
            f"{type(tf.distribute.get_strategy()).__name__}. Try using a "
            f"different Strategy, e.g. a MirroredStrategy. ({error})"
        ) from error


class _TfKerasWrapper(optimizer_protocol.ScaledLossProtocol):
    """What both classes add to tf-keras' wrappers. `variables`: the inner
    optimizer's, the loss scale's, then the wrapper's own."""

    _INNER_BASE = None  # The inner optimizers' base class.
    _built_for = ()  # Set with the overflow flags (`_build`).

    def __init__(self, inner_optimizer, loss_scale="dynamic", name=None, *,
                 initial_scale=None, dynamic_growth_steps=None, dynamic=None,
                 **kwargs):
        checks.inner_optimizer(
            inner_optimizer, self._INNER_BASE,
            _tf_keras_lso.BaseLossScaleOptimizer,
            "`tf.keras.optimizers.Optimizer` or "
            "`tf.keras.optimizers.experimental.Optimizer`")
        checks.of_type("name", name, (str, type(None)), "a string or None")
        optimizer_arguments.check_base_optimizer_arguments(kwargs)
        _check_strategy()  # As tf-keras' wrapper; before the scale is made.
        resolved = optimizer_arguments.claim(
            optimizer_arguments.resolve_loss_scale(
                loss_scale, dynamic, initial_scale, dynamic_growth_steps),
            self)
        optimizer_arguments.warn_if_scaling_bfloat16(
            resolved, tf_keras.mixed_precision.global_policy())
        # First: the legacy class's __setattr__ reads the inner optimizer.
        self._optimizer = inner_optimizer
        # tf-keras' flag: every wrapper, tf-keras' own too, now refuses it.
        setattr(inner_optimizer, private_api.TF_KERAS_WRAPPED, True)
        # Checkpoint dependencies are the inner optimizer's, as in tf-keras'
        # wrapper: both wrappers' checkpoints restore into each other.
        private_api.DelegatingTrackableMixin.__init__(self, inner_optimizer)
        self.name = name or "LossScaleOptimizer"
        self._loss_scale = resolved
        private_api.track(self, resolved, "loss_scale")
        with tf.init_scope():
            self._skipped_steps = tf.Variable(
                0, name="skipped_steps", dtype=tf.int64, trainable=False,
                aggregation=tf.VariableAggregation.NONE)
        private_api.track(self, self._skipped_steps, "skipped_steps")

    @staticmethod
    def _aggregates(skip_gradients_aggregation=False,
                    experimental_aggregate_gradients=True):
        """Whether the inner optimizer sums the gradients (not the caller)."""
        return (experimental_aggregate_gradients
                and not skip_gradients_aggregation)

    def _build(self, var_list):
        """Builds the inner optimizer and the per-variable overflow flags."""
        var_list = list(var_list)
        with loss_scaled_step.building_outside_traces():
            self._build_inner(var_list)
            if self._last_nonfinite is not None:
                return
            flags = tf.Variable(
                tf.zeros([len(var_list)], tf.int32), name="last_nonfinite",
                trainable=False, aggregation=tf.VariableAggregation.NONE)
        # Past automatic tracking, which would make them checkpoint
        # dependencies of the inner optimizer (see __init__).
        object.__setattr__(self, "_last_nonfinite", flags)
        object.__setattr__(self, "_built_for", var_list)

    def _positions(self, variables):
        index = {private_api.variable_key(v): i
                 for i, v in enumerate(self._built_for)}
        return [index[private_api.variable_key(v)] for v in variables]

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Applies the gradients, unscaled (`get_unscaled_gradients`) or scaled
        (`scale_loss`), if all are finite once aggregated across replicas by
        the inner optimizer (`kwargs` are its)."""
        self.check_unscaled()
        checks.replica_context()
        _check_strategy()
        loss_scaled_step.check_traceable(self._loss_scale)
        self._warn_if_not_scaled()
        grads, variables = checks.pairs(grads_and_vars)
        pairs = [(g, v) for g, v in zip(checks.gradients(grads, variables),
                                        variables) if g is not None]
        # Summed by the inner optimizer, or by the caller who said so, which
        # the step cannot take on trust.
        aggregated = self._aggregates(**kwargs)
        if aggregated:
            pairs = self._aggregate(pairs)
        grads, variables = (list(part) for part in zip(*pairs))
        self._build(variables)
        if self._loss_scaled and not self._caller_unscales:
            grads = loss_scaled_step.unscale_for_apply(
                grads, variables, self._loss_scale())

        def apply_fn(grads, variables):
            return self._apply_aggregated(list(zip(grads, variables)), name)

        parts = (loss_scaled_step.FULL_STEP if aggregated
                 else loss_scaled_step.summed_by_caller(
                     loss_scaled_step.FULL_STEP))
        step = loss_scaled_step.apply_or_skip(
            self._loss_scale, grads, variables, apply_fn, self._skip_record,
            stats=self._stats_for(variables), parts=parts, summed=True)
        return self.iterations if step is None else step

    def _warn_if_not_scaled(self):
        """tf-keras' warning for gradients of a loss never scaled."""
        if self._loss_scaled:
            return
        forgot = ("get_scaled_loss() before calling LossScaleOptimizer."
                  "apply_gradients() (you did call get_unscaled_gradients())"
                  if self._caller_unscales else "get_scaled_loss() and "
                  "LossScaleOptimizer.get_unscaled_gradients() before calling "
                  "LossScaleOptimizer.apply_gradients()")
        tf.compat.v1.logging.warning(
            f"You forgot to call LossScaleOptimizer.{forgot}. This will likely "
            "result in worse model quality: scale the loss with "
            "get_scaled_loss() in the tape, and unscale the gradients with "
            "get_unscaled_gradients().")

    def _all_variables(self):
        own = [self._skipped_steps] + (
            [] if self._last_nonfinite is None else [self._last_nonfinite])
        return [*self._inner_variables(), *self._loss_scale.variables, *own]

    def get_weights(self):
        return [variable.numpy() for variable in self._all_variables()]

    def set_weights(self, weights):
        """Sets `variables` (.h5 files) unless the scale refuses its values."""
        variables = self._all_variables()
        if len(weights) != len(variables):
            raise ValueError(f"LossScaleOptimizer has {len(variables)} "
                             f"variables, got {len(weights)} values: build it "
                             "first (optimizer.build(variables))")
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
        """Restores `save_own_variables`; built unlike the saved one, nothing."""
        count = len(self._all_variables())
        if len(store.keys()) != count:
            tf.get_logger().warning(
                f"Skipping variable loading for optimizer '{self.name}': it "
                f"has {count} variables, the saved one {len(store.keys())}. "
                "Build it first.")
            return
        self.set_weights([store[str(i)] for i in range(count)])

    def _serialize_inner(self):
        return tf_keras.optimizers.serialize(self._optimizer)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The wrapper of `config`, ours or tf-keras' wrapper's."""
        inner, kwargs = checks.optimizer_config(
            config, custom_objects, (_NEW_BASE, _LEGACY_BASE))
        if not isinstance(inner, (_NEW_BASE, _LEGACY_BASE)):
            inner = tf_keras.optimizers.deserialize(
                inner, custom_objects=custom_objects,
                use_legacy_optimizer=cls._INNER_BASE is _LEGACY_BASE)
        return wrap(inner, **kwargs)


@tf_keras.saving.register_keras_serializable(package="tf_lossscale",
                                             name="LossScaleOptimizer")
class LossScaleOptimizer(_TfKerasWrapper, _tf_keras_lso.LossScaleOptimizerV3):
    """Wraps a `tf_keras.optimizers.Optimizer`; see `_TfKerasWrapper`."""

    _INNER_BASE = _NEW_BASE
    # Automatic tracking would reach the inner optimizer before it is attached.
    __init__ = private_api.no_automatic_dependency_tracking(
        _TfKerasWrapper.__init__)

    def _build_inner(self, var_list):
        self._optimizer.build(var_list)

    def _aggregate(self, pairs):
        return self._optimizer.aggregate_gradients(pairs)

    def _apply_aggregated(self, pairs, name):
        del name  # As tf-keras' wrapper: a subclass's apply may not take it.
        return self._optimizer.apply_gradients(
            pairs, skip_gradients_aggregation=True)

    def _inner_variables(self):
        return self._optimizer.variables

    build = _TfKerasWrapper._build

    def finalize_variable_values(self, var_list):
        """tf-keras' wrapper's; first raises what XLA steps left to the host
        (`xla_checks`)."""
        xla_checks.act(self)
        super().finalize_variable_values(var_list)

    variables = property(_TfKerasWrapper._all_variables)


@tf_keras.saving.register_keras_serializable(
    package="tf_lossscale", name="LegacyLossScaleOptimizer")
class LegacyLossScaleOptimizer(_TfKerasWrapper,
                               _tf_keras_lso.LossScaleOptimizer):
    """Wraps a `tf_keras.optimizers.legacy.Optimizer`; see `_TfKerasWrapper`."""

    _INNER_BASE = _LEGACY_BASE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Slots TF 2.2's wrapper saved under `base_optimizer`.
        private_api.track(
            self, _tf_keras_lso.FakeOptimizerForRestoration(
                self._optimizer), "base_optimizer")

    def _build_inner(self, var_list):
        private_api.tf_keras_create_all_weights(self._optimizer, var_list)

    def apply_gradients(self, grads_and_vars, name=None,
                        experimental_aggregate_gradients=True):
        # OptimizerV2's signature. Not super(): autograph converts this
        # method in a tf.function, and a zero-argument super() fails there.
        return _TfKerasWrapper.apply_gradients(
            self, grads_and_vars, name,
            experimental_aggregate_gradients=experimental_aggregate_gradients)

    def _aggregate(self, pairs):
        return private_api.tf_keras_aggregate_legacy(self._optimizer, pairs)

    def _apply_aggregated(self, pairs, name):
        return self._optimizer.apply_gradients(
            pairs, name=name, experimental_aggregate_gradients=False)

    def _inner_variables(self):
        return self._optimizer.variables()

    # `build` as the other wrappers (OptimizerV2 has none).
    build = _create_all_weights = _TfKerasWrapper._build
    variables = _TfKerasWrapper._all_variables
    weights = property(_TfKerasWrapper._all_variables)


# What `isinstance(opt, tf_lossscale.LossScaleOptimizer)` also accepts.
WRAPPER_CLASSES = (LossScaleOptimizer, LegacyLossScaleOptimizer)
