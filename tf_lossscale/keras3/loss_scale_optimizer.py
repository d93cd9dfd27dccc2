"""`LossScaleOptimizer`: the Keras 3 optimizer wrapper driven by a `LossScale`.

A `keras.optimizers.LossScaleOptimizer` (`compile` keeps it) with none of
that class's behaviour (docs/guides/keras.md).
"""

import functools
import sys

import keras
import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.keras3 import saving
from tf_lossscale.loss_scales import xla_checks
from tf_lossscale.ops import replicas
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.step import optimizer_arguments
from tf_lossscale.step import optimizer_protocol

_NOT_GIVEN = object()

# Keys tf-keras wrote into optimizer configs, which Keras 3 refuses.
_TF_KERAS_ONLY_KEYS = ("is_legacy_optimizer", "jit_compile")


class _OneNameForEveryKeras(type):
    """`isinstance(opt, tf_lossscale.LossScaleOptimizer)` also holds for the
    tf-keras wrappers."""

    def __instancecheck__(cls, instance):
        return super().__instancecheck__(instance) or issubclass(
            type(instance), cls)

    def __subclasscheck__(cls, subclass):
        return super().__subclasscheck__(subclass) or (
            cls is LossScaleOptimizer
            and issubclass(subclass, _tf_keras_wrapper_classes()))


def _tf_keras_wrapper_classes():
    """The tf-keras wrapper classes, once imported; never imports tf_keras."""
    module = sys.modules.get("tf_lossscale.tf_keras.loss_scale_optimizer")
    return module.WRAPPER_CLASSES if module is not None else ()


def _for_tf_keras(inner_optimizer):
    """Whether `inner_optimizer` gets a tf-keras wrapper: a tf-keras
    optimizer, or (with `tf.keras` being tf-keras) no Keras 3 optimizer."""
    return optimizer_protocol.comes_from_tf_keras(inner_optimizer) or bool(
        optimizer_protocol.tf_keras_is_tf_keras() and _tf_keras_wrapper_classes()
        and not isinstance(inner_optimizer, keras.optimizers.Optimizer))


@keras.saving.register_keras_serializable(package="tf_lossscale")
class LossScaleOptimizer(saving.SavedState,
                         optimizer_arguments.InnerHyperparameters,
                         optimizer_protocol.ScaledLossProtocol,
                         keras.optimizers.LossScaleOptimizer,
                         metaclass=_OneNameForEveryKeras):
    """Wraps a Keras optimizer with loss scaling by a `tf_lossscale.LossScale`.

    Args:
      inner_optimizer: the `keras.optimizers.Optimizer` to wrap; each wrapper
        needs its own. A tf-keras optimizer gets the tf-keras wrapper, with
        the same arguments; `isinstance(opt, LossScaleOptimizer)` holds for
        both.
      loss_scale: anything `tf_lossscale.get` takes: a number (a fixed
        scale), `"dynamic"` (the default), a `LossScale` or its config, or a
        `LossScaleGroup` that several optimizers share (the optimizer
        joins it: `loss_scale` is then its `GroupMember`).
      name: the optimizer's name.
      initial_scale, dynamic_growth_steps, dynamic: instead of `loss_scale`,
        Keras' and tf-keras' arguments (a dynamic scale with multiplier 2;
        `dynamic=False` with `initial_scale`: a fixed one).
      **kwargs: base-optimizer arguments Keras writes into saved configs, at
        their default values only.

    Raises:
      TypeError: `inner_optimizer` is no Keras optimizer, or an argument is
        unknown or of the wrong type.
      ValueError: `inner_optimizer` already scales the loss
        (`DoubleScalingError`) or is wrapped already, or a loss-scale
        argument is invalid or conflicts with another.
    """

    def __new__(cls, inner_optimizer=_NOT_GIVEN, *args, **kwargs):
        # tf-keras users write the same call; tf_keras is imported for them.
        if inner_optimizer is not _NOT_GIVEN and _for_tf_keras(
                inner_optimizer):
            from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer  # pylint: disable=g-import-not-at-top
            return tf_keras_optimizer.wrap(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, inner_optimizer, loss_scale="dynamic", name=None, *,
                 initial_scale=None, dynamic_growth_steps=None, dynamic=None,
                 **kwargs):
        checks.inner_optimizer(
            inner_optimizer, keras.optimizers.Optimizer,
            keras.optimizers.LossScaleOptimizer, "`keras.optimizers.Optimizer`")
        if inner_optimizer.loss_scale_factor is not None:
            raise ValueError(
                "inner_optimizer has loss_scale_factor="
                f"{checks.summary(inner_optimizer.loss_scale_factor)}; the "
                "LossScaleOptimizer scales the loss itself, so leave it unset")
        checks.of_type("name", name, (str, type(None)), "a string or None")
        optimizer_arguments.check_base_optimizer_arguments(kwargs)
        resolved = optimizer_arguments.resolve_loss_scale(
            loss_scale, dynamic, initial_scale, dynamic_growth_steps)
        # Keras' own wrapper's constructor makes scale variables we do not use.
        private_api.init_without_keras_loss_scale_optimizer(self, name)
        resolved = optimizer_arguments.claim(resolved, self)
        self.inner_optimizer = inner_optimizer
        # tf-keras' flag: every wrapper, tf-keras' own too, now refuses it.
        setattr(inner_optimizer, private_api.TF_KERAS_WRAPPED, True)
        # Checkpoints hold the scale under `loss_scale`, where tf-keras put
        # it, not under the attribute's name automatic tracking would use.
        object.__setattr__(self, "_loss_scale", resolved)
        private_api.track(self, resolved, "loss_scale")
        with keras.name_scope(self.name):
            self._skipped_steps = keras.Variable(
                0, name="skipped_steps", dtype="int64", trainable=False,
                aggregation="none")
        optimizer_arguments.warn_if_scaling_bfloat16(
            resolved, keras.mixed_precision.global_policy())

    def build(self, var_list):
        self._hand_pending_restores_to_inner()
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        with keras.name_scope(self.name):
            # One flag per trainable variable, written only on skipped steps.
            self._last_nonfinite = keras.Variable(
                tf.zeros([len(var_list)], tf.int32), name="last_nonfinite",
                dtype="int32", trainable=False, aggregation="none")

    @property
    def _built_for(self):
        return private_api.keras_built_for(self)

    def _positions(self, variables):
        return [private_api.keras_variable_index(self, v) for v in variables]

    # The step's replaceable parts; the benchmark's ablations swap one.
    _step_parts = loss_scaled_step.FULL_STEP
    # Set by a model scaled per layer (`tf_lossscale.layerwise`); not saved.
    _gradient_scaling = None

    def apply_gradients(self, grads_and_vars):
        self.check_unscaled()
        self.apply(*checks.pairs(grads_and_vars))
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Applies `grads` unless the loss scale says this step overflowed.

        In a replica context, else `ReplicaContextError`.
        `trainable_variables` defaults to those the optimizer was built
        with. A refused argument changes nothing, not even the build."""
        checks.replica_context()
        replicas.check_supported()
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        elif not self.built:
            raise ValueError("The first apply needs trainable_variables, or "
                             "call optimizer.build(variables) first")
        variables = (self._built_for if trainable_variables is None
                     else trainable_variables)
        grads = checks.gradients(grads, variables)
        loss_scaled_step.check_traceable(self._loss_scale)
        if not self.built:
            with loss_scaled_step.building_outside_traces():
                self.build(trainable_variables)
        loss_scale, parts = self._loss_scale, self._step_parts
        stats = self._stats_for(variables)
        if self._gradient_scaling is not None:
            loss_scale, parts, stats = self._gradient_scaling.step(
                loss_scale, variables, parts, stats)
        if not self._caller_unscales:
            # Read before the update below can change the scale.
            grads = parts.unscale(grads, variables, self._loss_scale())
        loss_scaled_step.apply_or_skip(
            loss_scale, grads, trainable_variables,
            functools.partial(private_api.keras_apply_summed,
                              self.inner_optimizer),
            self._skip_record, stats=stats, parts=parts)

    def get_unscaled_gradients(self, grads):
        """TF 2.x protocol: returns `grads / scale`; ValueError for a model
        scaled per layer (use `scale_loss` and `apply_gradients`)."""
        if self._gradient_scaling is not None:
            raise ValueError(
                "get_unscaled_gradients cannot unscale the gradients of a "
                "model scaled per layer (each has its segment's scale): call "
                "optimizer.scale_loss(loss), then apply_gradients with the "
                "scaled gradients, which unscales each by its own")
        return super().get_unscaled_gradients(grads)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "tf_lossscale.LossScaleOptimizer is stateful (TensorFlow "
            "backend); use apply or apply_gradients")

    def finalize_variable_values(self, var_list):
        """The inner optimizer's; first raises what XLA steps left to the
        host (`xla_checks`)."""
        xla_checks.act(self)
        self.inner_optimizer.finalize_variable_values(var_list)

    def _serialize_inner(self):
        return keras.saving.serialize_keras_object(self.inner_optimizer)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The optimizer of `config`, in any shape Keras wrote; with
        `TF_USE_LEGACY_KERAS=1`, the tf-keras wrapper."""
        if optimizer_protocol.tf_keras_is_tf_keras():
            from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer  # pylint: disable=g-import-not-at-top
            return tf_keras_optimizer.LossScaleOptimizer.from_config(
                config, custom_objects)
        inner, kwargs = checks.optimizer_config(config, custom_objects)
        if isinstance(inner.get("config"), dict):
            inner = {**inner, "config": {
                key: value for key, value in inner["config"].items()
                if key not in _TF_KERAS_ONLY_KEYS}}
        return cls(keras.optimizers.deserialize(
            inner, custom_objects=custom_objects), **kwargs)
