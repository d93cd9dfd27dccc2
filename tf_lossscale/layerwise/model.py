"""`LayerwiseModel`: a functional model cut into segments, each backward pass
at its own gradient scale, with the factors among its weights.

It owns the factor rule's state (saved with its weights), binds its
`GradientScaling` layers to it, and when compiled attaches a
`step.SegmentedStep` to its `LossScaleOptimizer`.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale.keras3 import loss_scale_optimizer
from tf_lossscale.layerwise import boundary
from tf_lossscale.layerwise import rule as rule_lib
from tf_lossscale.layerwise import step as step_lib
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib

_CONFIG_KEY = "gradient_scaling"
_STATE = (("gradient_factors", "float32", "ones"),
          ("gradient_margins", "float32", "ones"),
          ("gradient_good_steps", "int64", "zeros"))


@keras.saving.register_keras_serializable(package="tf_lossscale")
class LayerwiseModel(keras.Model):
    """A functional model whose segments each run their backward pass at
    their own scale: S * F_k for segment k, S (the loss scale) for the last.

    Made by `tf_lossscale.layerwise.scale_per_layer`; a `.keras` file or a
    config gives it back (with `tf_lossscale` imported). Compile it with a
    `tf_lossscale.LossScaleOptimizer` (any other optimizer is wrapped in one
    with a dynamic loss scale); its steps then move the factors
    (`tf_lossscale.layerwise.rule`) and `LossScaleMonitor` logs them.
    """

    def _set_up_scaling(self, segments, rule):
        """Creates the factor state (under the current strategy scope) and
        binds the `GradientScaling` layers to it: `segments` lists each
        segment's top-level layer names, the top's last."""
        object.__setattr__(self, "_segments", [list(s) for s in segments])
        object.__setattr__(self, "_factor_rule", rule)
        lower = len(segments) - 1
        # Every factor starts at 1, within its bounds.
        initial = {"gradient_factors": keras.initializers.Constant(
            min(max(1.0, rule.min_factor), rule.max_factor))}
        for name, dtype, init in _STATE:
            # An attribute each, so that checkpoints name them.
            setattr(self, f"_{name}", self.add_weight(
                shape=(lower,), dtype=dtype,
                initializer=initial.get(name, init), trainable=False,
                name=name, aggregation="none", autocast=False))
        # The tuple is no state of its own.
        object.__setattr__(self, "_factor_state", rule_lib.FactorState(*(
            getattr(self, f"_{name}") for name, _, _ in _STATE)))
        boundaries = [layer for layer in self.layers
                      if isinstance(layer, boundary.GradientScaling)]
        object.__setattr__(self, "_boundary_pairs", sorted(
            {(layer.producer, layer.consumer) for layer in boundaries}))
        object.__setattr__(self, "_ratios", None)
        for layer in boundaries:
            layer.bind(self._ratio)

    def _boundary_ratios(self):
        """`{(producer, consumer): F_producer / F_consumer}` for every
        boundary, from one read of the factors (the top's is 1): a divide a
        boundary, none into the top."""
        pairs = self._boundary_pairs
        top = len(self._segments) - 1
        factors = tf.unstack(tf.convert_to_tensor(self._factor_state.factors),
                             num=top) if pairs else []
        return {(producer, consumer): factors[producer] if consumer == top
                else 1.0 / factors[consumer] if producer == top
                else factors[producer] / factors[consumer]
                for producer, consumer in pairs}

    def _ratio(self, producer, consumer):
        """A boundary's ratio: this call's (see `call`), or read alone when
        a boundary runs outside it."""
        ratios = self._ratios
        if ratios is None:
            ratios = self._boundary_ratios()
        return ratios[(producer, consumer)]

    def call(self, inputs, training=None, mask=None, **kwargs):
        """Keras' own (its signature too: Keras passes `training` and `mask`
        only to a `call` that names them), with every boundary's ratio from
        one read of the factors."""
        object.__setattr__(self, "_ratios", self._boundary_ratios())
        try:
            return super().call(inputs, training=training, mask=mask,
                                **kwargs)
        finally:
            object.__setattr__(self, "_ratios", None)

    @property
    def segments(self):
        """Each segment's top-level layer names, from the inputs to the
        output (the last segment is scaled by the loss scale alone)."""
        return [list(s) for s in self._segments]

    @property
    def factor_state(self):
        """The factor rule's state variables, `rule.FactorState(factors,
        margins, good_steps)`: what carrying a run on copies
        (`tf_lossscale.diagnosis.carry_on`)."""
        return self._factor_state

    @property
    def factor_rule(self):
        """The `rule.FactorRule` the factors follow."""
        return self._factor_rule

    def gradient_factors(self):
        """`{segment name: F}`, a segment named by its first layer, the
        last segment's F being 1. Syncs device and host."""
        return self._plan().factor_values()

    def _plan(self):
        """The `step.SegmentedStep` of this model's segments and state."""
        segment_of = {}
        for index, names in enumerate(self._segments):
            for name in names:
                for variable in self.get_layer(name).trainable_weights:
                    segment_of.setdefault(id(variable), index)
        return step_lib.SegmentedStep(
            self._factor_state, self._factor_rule, segment_of,
            [names[0] for names in self._segments])

    def compile(self, optimizer="rmsprop", *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
        """Keras' `compile`, with `optimizer` a `tf_lossscale.
        LossScaleOptimizer` (another optimizer is wrapped in one with a
        dynamic loss scale), whose steps then scale per segment.

        Raises:
          TypeError, ValueError: a loss scale that does not skip non-finite
            steps (per-layer scaling must skip the steps its factors
            overflow), or Keras' own refusals.
        """
        optimizer = _scaling_optimizer(optimizer)
        super().compile(optimizer, *args, **kwargs)
        object.__setattr__(optimizer, "_gradient_scaling", self._plan())

    def compile_from_config(self, config):
        """Keras' own (Keras skips it for a model whose `compile` is not
        Keras'): compiles from a saved compile config, then builds the
        optimizer."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {**super().get_config(),
                _CONFIG_KEY: {"segments": self.segments,
                              **self._factor_rule.get_config()}}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        scaling = dict(config.pop(_CONFIG_KEY))
        segments = scaling.pop("segments")
        model = super().from_config(config, custom_objects=custom_objects)
        model._set_up_scaling(segments, rule_lib.checked_rule(**scaling))  # pylint: disable=protected-access
        return model

    def load_own_variables(self, store):
        """Keras' own, after checking the stored factor state: factors and
        margins finite and > 0, good steps >= 0 (else ValueError, nothing
        assigned)."""
        for (name, _, _), key in zip(_STATE, sorted(store.keys(), key=int)):
            values = np.asarray(store[key])
            counts = name.endswith("steps")
            if not np.all(np.isfinite(values)) or not np.all(
                    values >= 0 if counts else values > 0):
                raise ValueError(
                    f"the file's {name} of model {self.name!r} must be "
                    f"finite and > 0 (good steps >= 0), got "
                    f"{checks.summary(values.tolist())}")
        super().load_own_variables(store)


def _scaling_optimizer(optimizer):
    """`optimizer` as a tf_lossscale `LossScaleOptimizer` whose loss scale
    skips non-finite steps."""
    optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, loss_scale_optimizer.LossScaleOptimizer):
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = loss_scale_optimizer.LossScaleOptimizer(
                optimizer.inner_optimizer,
                initial_scale=float(optimizer.initial_scale),
                dynamic_growth_steps=optimizer.dynamic_growth_steps)
        else:
            optimizer = loss_scale_optimizer.LossScaleOptimizer(optimizer)
    scale = optimizer.loss_scale
    skips = isinstance(scale, dynamic_loss_scale.DynamicLossScale) or (
        isinstance(scale, loss_scale_lib.FixedLossScale)
        and scale.skip_non_finite)
    if not skips:
        raise ValueError(
            f"a model scaled per layer needs a loss scale that skips "
            f"non-finite steps, got {checks.summary(scale)}: use a "
            "DynamicLossScale, or FixedLossScale(..., skip_non_finite=True)")
    return optimizer
