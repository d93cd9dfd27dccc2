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

What the constructor accepts, and those hyperparameters, are in
`tf_lossscale.optimizer_arguments`; unscaling (packed for tiny gradients,
bit-identical to a divide) is in `tf_lossscale.unscaling`; saving (`.keras`
files, checkpoints, and what they can be restored from) is in
`tf_lossscale.optimizer_saving`.
"""

import keras
import tensorflow as tf

from tf_lossscale import distribution
from tf_lossscale import gradient_checks
from tf_lossscale import legacy_configs
from tf_lossscale import loss_scale as loss_scale_lib
from tf_lossscale import optimizer_arguments
from tf_lossscale import optimizer_saving
from tf_lossscale import serialization
from tf_lossscale import unscaling


@keras.saving.register_keras_serializable(package="tf_lossscale")
class LossScaleOptimizer(optimizer_arguments.InnerHyperparameters,
                         keras.optimizers.LossScaleOptimizer):
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
    """

    def __init__(self, inner_optimizer, loss_scale="dynamic", name=None, *,
                 initial_scale=None, dynamic_growth_steps=None, dynamic=None,
                 **kwargs):
        optimizer_arguments.check_inner_optimizer(inner_optimizer)
        optimizer_arguments.check_base_optimizer_kwargs(kwargs)
        resolved = optimizer_arguments.resolve_loss_scale(
            loss_scale, dynamic, initial_scale, dynamic_growth_steps)
        # Keras' own LossScaleOptimizer.__init__ creates its scale variables;
        # ours come from the LossScale, so that constructor is skipped.
        keras.optimizers.Optimizer.__init__(  # pylint: disable=non-parent-init-called
            self, learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        optimizer_arguments.claim(inner_optimizer, self)
        # Checkpoints hold the loss scale under `loss_scale`, where tf-keras
        # put it, not under the attribute's name that automatic tracking of
        # `self._loss_scale = ...` would use.
        object.__setattr__(self, "_loss_scale", resolved)
        self._track_trackable(resolved, name="loss_scale")
        # `fit` uses the Keras 3 protocol; the TF 2.x methods switch it.
        self._caller_unscales = False
        # Set by get_scaled_loss until get_unscaled_gradients is called.
        self._awaiting_unscale = False
        with keras.name_scope(self.name):
            self._skipped_steps = keras.Variable(
                0, name="skipped_steps", dtype="int64", trainable=False,
                aggregation="none")
        optimizer_arguments.warn_if_scaling_bfloat16(resolved)

    # Keras-compatible attributes (the inner optimizer's hyperparameters come
    # from InnerHyperparameters).

    @property
    def loss_scale(self):
        """The `tf_lossscale.LossScale`; call it for the current scale."""
        return self._loss_scale

    @property
    def skipped_steps(self):
        """Steps skipped for non-finite gradients, a scalar int64 tensor."""
        return tf.convert_to_tensor(self._skipped_steps)

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
    def dynamic(self):
        """Whether the loss scale is dynamic (a `DynamicLossScale`)."""
        return isinstance(self._loss_scale, loss_scale_lib.DynamicLossScale)

    @property
    def dynamic_scale(self):
        """The current scale, as Keras' own LossScaleOptimizer names it."""
        return self._loss_scale()

    @property
    def dynamic_counter(self):
        """Good steps since the scale last changed; None for a fixed scale."""
        return self._loss_scale.good_steps if self.dynamic else None

    @property
    def variables(self):
        """All state: the wrapper's, the loss scale's, the inner optimizer's."""
        return optimizer_saving.listed_variables(self)

    @property
    def initial_scale(self):
        config = self._loss_scale.get_config()
        return config.get("initial_loss_scale",
                          config.get("loss_scale_value"))

    @property
    def dynamic_growth_steps(self):
        return self._loss_scale.get_config().get("increment_period")

    def build(self, var_list):
        # A checkpoint restored before now left the inner optimizer's slots
        # pending on the wrapper: they must wait on the inner optimizer.
        optimizer_saving.hand_pending_restores_to_inner(self)
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

        A list of `variable.path` strings in the order of the variables the
        optimizer was built with; `[]` before the first skipped step (or
        before the optimizer is built). Steps that are applied leave it
        unchanged, and computing it costs nothing on them: the flags are
        worked out only when a step is skipped.
        """
        if not self.built:
            return []
        flags = self._last_nonfinite.numpy()
        return [variable.path for variable, flag
                in zip(self._trainable_variables, flags) if flag]

    # Scaling and unscaling.

    def _scale(self, loss):
        if callable(loss):
            return lambda: self._scale(loss())
        loss = tf.convert_to_tensor(loss)
        return loss * tf.cast(self._loss_scale(), loss.dtype)

    def scale_loss(self, loss):
        """Keras 3 protocol: returns `loss * scale`; `apply_gradients` then
        takes the scaled gradients and unscales them."""
        self._caller_unscales = False
        self._awaiting_unscale = False
        return self._scale(loss)

    def get_scaled_loss(self, loss):
        """TF 2.x protocol: returns `loss * scale` in the loss's dtype.

        `loss` may be a callable returning the loss; a callable returning the
        scaled loss comes back. Unscale the gradients with
        `get_unscaled_gradients` before `apply_gradients`.
        """
        self._caller_unscales = False
        self._awaiting_unscale = True
        return self._scale(loss)

    def get_unscaled_gradients(self, grads):
        """TF 2.x protocol: returns `grads / scale`, structure and dtypes kept.

        `None` entries stay None; `tf.IndexedSlices` stay IndexedSlices.
        """
        self._caller_unscales = True
        self._awaiting_unscale = False
        return unscaling.unscale_structure(grads, self._loss_scale())

    # Applying.

    def apply_gradients(self, grads_and_vars):
        if self._awaiting_unscale:
            raise ValueError(
                "apply_gradients got the gradients of get_scaled_loss's loss "
                "without get_unscaled_gradients: they are still multiplied by "
                "the loss scale. Call grads = optimizer."
                "get_unscaled_gradients(grads) before apply_gradients, or use "
                "optimizer.scale_loss(loss) instead of get_scaled_loss, and "
                "apply_gradients unscales them itself.")
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Applies `grads` unless the loss scale says this step overflowed.

        Must be called in a replica context (as `fit` and `strategy.run` do,
        or with no strategy at all).
        """
        if tf.distribute.has_strategy() and (
                tf.distribute.in_cross_replica_context()):
            raise RuntimeError(
                "LossScaleOptimizer.apply_gradients must be called in a "
                "replica context: inside strategy.run (or model.fit), not "
                "directly under strategy.scope()")
        distribution.check_supported()
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "The first apply needs trainable_variables, or call "
                    "optimizer.build(variables) first")
            with keras.name_scope(self.name):
                self.build(trainable_variables)
        if not self._caller_unscales:
            # Read before the update below can change the scale.
            grads = self._unscale_for_apply(
                grads, trainable_variables, self._loss_scale())
        distribution.call_in_cross_replica_context(
            self._apply_if_all_finite, grads, trainable_variables)

    def _unscale_for_apply(self, grads, trainable_variables, scale):
        # Variables that take their gradient as their new value (float8
        # scales and amax histories) get it as computed, as Keras' own
        # LossScaleOptimizer does; they are still checked for finiteness.
        variables = trainable_variables or self._trainable_variables
        return unscaling.unscale(
            grads, scale,
            keep=[self._overwrite_variable_with_gradient(variable)
                  for variable in variables])

    def _apply_if_all_finite(self, grads, trainable_variables):
        # Cross-replica context: `grads` (unscaled) may be per-replica values.
        # One finiteness flag is reduced over all replicas and workers, so the
        # branch below, whose inner apply all-reduces the gradients, is taken
        # identically everywhere.
        _, should_apply = self._update_loss_scale(grads)

        def apply_inner():
            distribution.call_for_each_replica(
                self.inner_optimizer.apply, grads, trainable_variables)

        def skip():
            self._skipped_steps.assign_add(1)
            self._record_nonfinite(grads, trainable_variables)

        if isinstance(should_apply, bool):
            if should_apply:
                apply_inner()
            else:
                skip()
        else:
            tf.cond(should_apply, apply_inner, skip)

    def _update_loss_scale(self, grads):
        loss_scale = self._loss_scale
        update_from_flag = getattr(loss_scale, "_update_from_all_finite", None)
        if update_from_flag is None:
            # A user-defined LossScale: the public contract.
            return loss_scale.update(grads)
        if not getattr(loss_scale, "_needs_finiteness", True):
            return update_from_flag(tf.constant(True))
        return update_from_flag(
            distribution.all_replicas_true(self.check_finite, grads))

    def _record_nonfinite(self, grads, trainable_variables):
        # Only on skipped steps: exact per-gradient flags, combined over
        # replicas, stored by the variable's index in the built list.
        variables = trainable_variables or self._trainable_variables
        positions = [self._get_variable_index(v) for v in variables]
        size = self._last_nonfinite.shape[0]

        def local_flags(local_grads):
            finite = gradient_checks.finite_flags(list(local_grads))
            by_position = dict(zip(positions, finite))
            return tf.stack([
                tf.logical_not(by_position[i]) if i in by_position
                else tf.constant(False) for i in range(size)])

        nonfinite = distribution.any_replica_true(local_flags, grads)
        self._last_nonfinite.assign(tf.cast(nonfinite, tf.int32))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "tf_lossscale.LossScaleOptimizer is stateful (TensorFlow backend); "
            "use apply or apply_gradients")

    def check_finite(self, grads):
        """Whether every gradient on this replica is finite (a bool tensor)."""
        return gradient_checks.all_finite(grads)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # Saving: see tf_lossscale.optimizer_saving.

    def save_own_variables(self, store):
        optimizer_saving.save_own_variables(self, store)

    def load_own_variables(self, store):
        optimizer_saving.load_own_variables(self, store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return optimizer_saving.checkpoint_children(
            self, super()._trackable_children(save_type, **kwargs),
            save_type, **kwargs)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer),
            "loss_scale": serialization.serialize(self._loss_scale),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates the optimizer from its config or an older Keras format."""
        inner_config, kwargs = legacy_configs.to_constructor_arguments(config)
        inner = keras.optimizers.deserialize(inner_config,
                                             custom_objects=custom_objects)
        return cls(inner, **kwargs)
