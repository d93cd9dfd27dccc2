"""`LossScaleOptimizer`: a Keras 3 optimizer wrapper driven by a `LossScale`.

It subclasses `keras.optimizers.LossScaleOptimizer` so that `model.compile`
under the `mixed_float16` policy recognises it and does not wrap it a second
time, but it replaces all of that class's behaviour:

* any `tf_lossscale` loss scale (fixed, dynamic with any multiplier, yours);
* under `tf.distribute`, the skip decision is taken from *every* replica's
  gradients on *every* worker with one scalar all-reduce, before any branch
  holding a collective, so all replicas apply or all skip together;
* a skipped step leaves weights, optimizer slots and `iterations` untouched,
  adds one to `skipped_steps` and records which variables' gradients were not
  finite (`last_nonfinite_variables()`; nothing of that runs on applied
  steps);
* variables that take their gradient as their new value (float8 scales and
  amax histories, `overwrite_with_gradient`) get it as computed, not
  unscaled, as with Keras' own wrapper;
* the TF 2.x methods `get_scaled_loss` and `get_unscaled_gradients` work.

Two protocols for a training step are supported:

* Keras 3 (what `fit` does): `scaled = opt.scale_loss(loss)`, gradients of
  `scaled`, then `opt.apply_gradients(...)` with those *scaled* gradients;
  the optimizer unscales them.
* TF 2.x: `scaled = opt.get_scaled_loss(loss)`, gradients of `scaled`,
  `grads = opt.get_unscaled_gradients(scaled_grads)`, optional clipping, then
  `opt.apply_gradients(...)` with the *unscaled* gradients.

`apply_gradients` follows whichever of `scale_loss` or
`get_scaled_loss`/`get_unscaled_gradients` was called last (while tracing, in a
`tf.function`), so one step must not mix the two. `get_scaled_loss` followed by
`apply_gradients` without `get_unscaled_gradients` would apply gradients still
multiplied by the scale; it raises a ValueError instead (at trace time inside a
`tf.function`).

Attributes as Keras' and tf-keras' wrappers have them: `inner_optimizer`,
`dynamic`, `initial_scale`, `dynamic_growth_steps`, `dynamic_scale`,
`dynamic_counter`, `learning_rate` and `iterations` (the inner optimizer's).
Per-step hyperparameters of the inner optimizer (`weight_decay`, `clipnorm`,
...) read and write through to it; build-time ones set on the wrapper raise.

The step itself (agreement across replicas, the scale's update, apply or
skip, the overflow record) is `tf_lossscale.step.loss_scaled_step`, shared with the
other wrappers; this class adapts it to Keras 3. What the constructor accepts,
and those hyperparameters, are in `tf_lossscale.step.optimizer_arguments`;
unscaling (packed for tiny gradients, bit-identical to a divide) is in
`tf_lossscale.ops.unscaling`; saving (`.keras`
files, checkpoints, and what they can be restored from) is in
`tf_lossscale.keras3.saving`.
"""

import sys

import keras
import tensorflow as tf

from tf_lossscale.step import legacy_configs
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.step import optimizer_arguments
from tf_lossscale.step import optimizer_protocol
from tf_lossscale.keras3 import saving
from tf_lossscale._internal import private_api
from tf_lossscale._internal import step_arguments
from tf_lossscale.step import wrapper_core
from tf_lossscale.loss_scales import xla_checks


_NOT_GIVEN = object()


class _OneNameForEveryKeras(type):
    """`isinstance(opt, tf_lossscale.LossScaleOptimizer)` is True for what
    `tf_lossscale.LossScaleOptimizer(...)` returns, whichever Keras: the
    tf-keras wrappers (`tf_lossscale.tf_keras.loss_scale_optimizer`) subclass tf-keras'
    own wrapper instead, so they answer here. Subclasses of the Keras 3 class
    keep the plain answer."""

    def __instancecheck__(cls, instance):
        return super().__instancecheck__(instance) or (
            cls is LossScaleOptimizer and isinstance(instance, _tf_keras_wrapper_classes()))

    def __subclasscheck__(cls, subclass):
        return super().__subclasscheck__(subclass) or (
            cls is LossScaleOptimizer and issubclass(subclass, _tf_keras_wrapper_classes()))


def _tf_keras_wrapper_classes():
    """The tf-keras wrapper classes, if their module was imported (no
    tf-keras wrapper exists before); never imports tf_keras."""
    module = sys.modules.get("tf_lossscale.tf_keras.loss_scale_optimizer")
    return module.WRAPPER_CLASSES if module is not None else ()


def _for_tf_keras(inner_optimizer):
    """Whether `inner_optimizer` gets a tf-keras wrapper: a tf-keras
    optimizer; with `tf.keras` being tf-keras (whose wrappers are imported
    with the package then), anything but a Keras 3 optimizer, so a mistake
    is reported in tf-keras' terms."""
    if optimizer_protocol.comes_from_tf_keras(inner_optimizer):
        return True
    return bool(optimizer_protocol.tf_keras_is_tf_keras()
                and _tf_keras_wrapper_classes()
                and not isinstance(inner_optimizer,
                                   keras.optimizers.Optimizer))


@keras.saving.register_keras_serializable(package="tf_lossscale")
class LossScaleOptimizer(private_api.ChoosesCheckpointChildren,
                         optimizer_arguments.InnerHyperparameters,
                         optimizer_protocol.ScaledLossProtocol,
                         keras.optimizers.LossScaleOptimizer,
                         metaclass=_OneNameForEveryKeras):
    """Wraps a Keras optimizer with loss scaling by a `tf_lossscale.LossScale`.

    Args:
      inner_optimizer: the `keras.optimizers.Optimizer` to wrap; each wrapper
        needs its own.
      loss_scale: anything `tf_lossscale.get` accepts: a number (fixed scale),
        `"dynamic"` (the default: `DynamicLossScale()`), a `LossScale` or a
        serialized loss scale dict.
      name: the optimizer's name.
      initial_scale, dynamic_growth_steps: for drop-in use in place of
        `keras.mixed_precision.LossScaleOptimizer`: a `DynamicLossScale` with
        these values and multiplier 2.
      dynamic: as in tf-keras 2.4+: `dynamic=False` with `initial_scale` gives
        a `FixedLossScale(initial_scale)`.
      **kwargs: base-optimizer arguments that Keras writes into saved configs,
        accepted only at their default values.

    Raises:
      TypeError: `inner_optimizer` is not a Keras optimizer, or an argument
        is unknown or of the wrong type.
      ValueError: `inner_optimizer` is a LossScaleOptimizer or already
        wrapped, `loss_scale` conflicts with the Keras-style arguments, or a
        loss-scale argument is invalid.

    `iterations` is the inner optimizer's: it counts applied steps only.
    `skipped_steps` counts the steps skipped for non-finite gradients.

    A tf-keras (Keras 2) inner optimizer gets the tf-keras wrapper instead,
    `tf_lossscale.tf_keras.loss_scale_optimizer`, with the same arguments; with
    `TF_USE_LEGACY_KERAS=1` so does anything that is not a Keras 3
    optimizer, refused in tf-keras' terms. `isinstance(opt,
    tf_lossscale.LossScaleOptimizer)` holds for both kinds.
    """

    def __new__(cls, inner_optimizer=_NOT_GIVEN, *args, **kwargs):
        # tf-keras users write the same `tf_lossscale.LossScaleOptimizer(
        # tf.keras.optimizers.Adam())`; tf_keras is imported only for them.
        if inner_optimizer is not _NOT_GIVEN and _for_tf_keras(
                inner_optimizer):
            from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer  # pylint: disable=g-import-not-at-top
            return tf_keras_optimizer.wrap(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, inner_optimizer, loss_scale="dynamic", name=None, *,
                 initial_scale=None, dynamic_growth_steps=None, dynamic=None,
                 **kwargs):
        optimizer_arguments.check_inner_optimizer(inner_optimizer)
        optimizer_arguments.check_name(name)
        optimizer_arguments.check_base_optimizer_kwargs(kwargs)
        resolved = optimizer_arguments.resolve_loss_scale(
            loss_scale, dynamic, initial_scale, dynamic_growth_steps)
        # Keras' own LossScaleOptimizer.__init__ creates its scale variables;
        # ours come from the LossScale, so that constructor is skipped.
        private_api.init_without_keras_loss_scale_optimizer(self, name)
        self.inner_optimizer = inner_optimizer
        optimizer_arguments.claim(inner_optimizer, self)
        # Checkpoints hold the loss scale under `loss_scale`, where tf-keras
        # put it, not under the attribute's name that automatic tracking of
        # `self._loss_scale = ...` would use.
        object.__setattr__(self, "_loss_scale", resolved)
        private_api.track(self, resolved, "loss_scale")
        self._reset_protocol()
        with keras.name_scope(self.name):
            self._skipped_steps = keras.Variable(
                0, name="skipped_steps", dtype="int64", trainable=False,
                aggregation="none")
        optimizer_arguments.warn_if_scaling_bfloat16(resolved)

    # Keras-compatible attributes come from ScaledLossProtocol (the loss
    # scale's) and InnerHyperparameters (the inner optimizer's).

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def variables(self):
        """All state: the wrapper's, the loss scale's, the inner optimizer's."""
        return saving.listed_variables(self)

    def build(self, var_list):
        # A checkpoint restored before now left the inner optimizer's slots
        # pending on the wrapper: they must wait on the inner optimizer.
        saving.hand_pending_restores_to_inner(self)
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        with keras.name_scope(self.name):
            # One flag per trainable variable, written only on skipped steps.
            self._last_nonfinite = keras.Variable(
                tf.zeros([len(var_list)], tf.int32), name="last_nonfinite",
                dtype="int32", trainable=False, aggregation="none")

    def last_nonfinite_variables(self):
        """Paths of the variables whose gradients held NaN or +-Inf on the
        most recent skipped step, on any replica or worker.

        A list of `variable.path` strings (the tf-keras wrapper returns the
        same: `tf_lossscale.step.wrapper_core.nonfinite_paths`) in the order of
        the variables the optimizer was built with; `[]` before the first skipped step (or
        before the optimizer is built). Steps that are applied leave it
        unchanged, and computing it costs nothing on them: the flags are
        worked out only when a step is skipped.
        """
        if not self.built:
            return []
        return wrapper_core.nonfinite_paths(
            private_api.keras_built_for(self), self._last_nonfinite)

    # Applying.

    # The step's replaceable parts; the benchmark's ablations swap one.
    _step_parts = loss_scaled_step.FULL_STEP

    def apply_gradients(self, grads_and_vars):
        self.check_unscaled()
        grads, trainable_variables = step_arguments.split_pairs(
            grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Applies `grads` unless the loss scale says this step overflowed.

        Must be called in a replica context (as `fit` and `strategy.run` do,
        or with no strategy at all): else `checks.ReplicaContextError`
        (a ValueError and a RuntimeError). `trainable_variables` defaults to those
        the optimizer was built with. Gradients and variables are checked
        first (`tf_lossscale._internal.step_arguments`): a refused call changes
        nothing, the optimizer's build included.
        """
        wrapper_core.open_step()
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        elif not self.built:
            raise ValueError(
                "The first apply needs trainable_variables, or call "
                "optimizer.build(variables) first")
        variables = (private_api.keras_built_for(self)
                     if trainable_variables is None else trainable_variables)
        grads = step_arguments.check(grads, variables)
        loss_scaled_step.check_traceable(self._loss_scale)
        if not self.built:
            # build opens the optimizer's name scope itself.
            with loss_scaled_step.building_outside_traces():
                self.build(trainable_variables)
        parts = self._step_parts
        if not self._caller_unscales:
            # Read before the update below can change the scale.
            grads = parts.unscale(grads, variables, self._loss_scale())
        loss_scaled_step.apply_or_skip(
            self._loss_scale, grads, trainable_variables,
            self.inner_optimizer.apply, self._skip_record,
            stats=self._stats_for(variables), parts=parts)

    @property
    def _skip_record(self):
        return wrapper_core.skip_record(
            self._skipped_steps, self._last_nonfinite,
            private_api.keras_built_for(self),
            lambda v: private_api.keras_variable_index(self, v))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "tf_lossscale.LossScaleOptimizer is stateful (TensorFlow backend); "
            "use apply or apply_gradients")

    def finalize_variable_values(self, var_list):
        """The inner optimizer's; first, at the end of `fit`, raises what XLA
        steps left to the host (one small read, only once a step was
        traced under XLA: `tf_lossscale.loss_scales.xla_checks`)."""
        xla_checks.act(self)
        self.inner_optimizer.finalize_variable_values(var_list)

    # Saving: see tf_lossscale.keras3.saving.

    def save_own_variables(self, store):
        saving.save_own_variables(self, store)

    def load_own_variables(self, store):
        saving.load_own_variables(self, store)

    def _checkpoint_children(self, found, save_type, **kwargs):
        return saving.checkpoint_children(
            self, found, save_type, **kwargs)

    def get_config(self):
        return optimizer_protocol.wrapper_config(
            self, keras.saving.serialize_keras_object(self.inner_optimizer))

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates the optimizer from its config or an older Keras format;
        with `TF_USE_LEGACY_KERAS=1`, the tf-keras wrapper."""
        if optimizer_protocol.tf_keras_is_tf_keras():
            from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer  # pylint: disable=g-import-not-at-top
            return tf_keras_optimizer.LossScaleOptimizer.from_config(
                config, custom_objects)
        inner_config, kwargs = legacy_configs.to_constructor_arguments(
            config, custom_objects)
        inner = keras.optimizers.deserialize(inner_config,
                                             custom_objects=custom_objects)
        return cls(inner, **kwargs)
