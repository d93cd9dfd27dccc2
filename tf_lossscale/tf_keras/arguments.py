"""What the tf-keras `LossScaleOptimizer` accepts, in tf-keras' own terms.

tf-keras users' code and tests match the exceptions and warnings of
`tf.keras.mixed_precision.LossScaleOptimizer`: their types and the phrases
they match are kept here (for the same mistakes), each followed by what
tf_lossscale adds. The Keras 3 wrapper's checks are in
`tf_lossscale.step.optimizer_arguments`, which the tf-keras wrapper also uses for
what tf-keras does not check.

* `check_inner`: an optimizer of tf-keras, not a loss-scale wrapper (ours or
  tf-keras'), not wrapped already.
* `check_keras_style_arguments`: tf-keras' `dynamic`, `initial_scale` and
  `dynamic_growth_steps`.
* `check_strategy`: the strategies loss scaling cannot serve.
* `warn_if_not_scaled`: `apply_gradients` on gradients of a loss that was
  never scaled, or never unscaled, as tf-keras warns.
"""

import tensorflow as tf

from tf_lossscale.ops import replicas
from tf_lossscale._internal import private_api
from tf_lossscale._internal import checks


def check_inner(inner_optimizer, optimizer_bases, loss_scale_optimizer_base):
    """Raises as tf-keras' wrapper does for an `inner_optimizer` it refuses.

    Args:
      inner_optimizer: what the caller passed.
      optimizer_bases: tf-keras' optimizer base classes (a tuple).
      loss_scale_optimizer_base: tf-keras' loss-scale wrapper base class,
        which tf_lossscale's tf-keras wrappers subclass.

    Raises:
      TypeError: not a tf-keras optimizer; `checks.DoubleScalingError`
        (a TypeError, as tf-keras raises, and a ValueError): a loss-scale
        wrapper.
      ValueError: already wrapped by a loss-scale wrapper.
    """
    if isinstance(inner_optimizer, loss_scale_optimizer_base):
        raise checks.DoubleScalingError(
            "LossScaleOptimizer cannot wrap another LossScaleOptimizer, but "
            f"got: {checks.summary(inner_optimizer)} as inner_optimizer; "
            "wrapping it again would scale the loss twice")
    if not isinstance(inner_optimizer, optimizer_bases):
        raise TypeError(
            '"inner_optimizer" must be an instance of '
            "`tf.keras.optimizers.Optimizer` or "
            "`tf.keras.optimizers.experimental.Optimizer`, but got: "
            f"{checks.summary(inner_optimizer)} of type "
            f"{type(inner_optimizer).__name__}")
    # tf-keras' wrapper and ours both mark the optimizer they wrap.
    if private_api.tf_keras_is_wrapped(inner_optimizer):
        raise ValueError(
            '"inner_optimizer" is already wrapped by a LossScaleOptimizer. '
            "An optimizer can only be wrapped by a single LossScaleOptimizer: "
            "both would apply their updates to the same weights; give each "
            "wrapper its own optimizer")


def check_keras_style_arguments(dynamic, initial_scale, dynamic_growth_steps):
    """Raises as tf-keras' wrapper does for `dynamic`, `initial_scale` and
    `dynamic_growth_steps` it refuses; `None` means not given.

    Raises:
      TypeError: `dynamic` is not a bool.
      ValueError: `dynamic=False` without `initial_scale`, or with
        `dynamic_growth_steps`.
    """
    if dynamic is not None and not isinstance(dynamic, bool):
        # tf-keras' second positional argument was once the loss scale.
        raise TypeError(
            '"dynamic" argument to LossScaleOptimizer.__init__ must be a '
            f"bool, but got: {checks.summary(dynamic)} (a loss scale goes "
            "in loss_scale=)")
    if dynamic is False and initial_scale is None:
        raise ValueError(
            '"initial_scale" must be specified if "dynamic" is False: it is '
            "the fixed scale")
    if dynamic is False and dynamic_growth_steps is not None:
        raise ValueError(
            '"dynamic_growth_steps" must be None if "dynamic" is False, but '
            f"got: {checks.summary(dynamic_growth_steps)}")


def check_strategy():
    """Raises ValueError, in tf-keras' words and ours, under a strategy that
    loss scaling cannot serve (its variables are not mirrored per replica)."""
    try:
        replicas.check_supported()
    except ValueError as error:
        name = type(tf.distribute.get_strategy()).__name__
        raise ValueError(
            "Loss scaling is not supported with the tf.distribute.Strategy: "
            f"{name}. Try using a different Strategy, e.g. a MirroredStrategy. "
            f"({error})") from error


_EXAMPLE = """
    with tf.GradientTape() as tape:
      loss = loss_fn()
      scaled_loss = opt.get_scaled_loss(loss)
    scaled_grads = tape.gradient(scaled_loss, vars)
    grads = opt.get_unscaled_gradients(scaled_grads)
    opt.apply_gradients(zip(grads, vars))"""


def warn_if_not_scaled(loss_scaled, gradients_unscaled):
    """Warns through TensorFlow's logger, as tf-keras does, when
    `apply_gradients` gets gradients of a loss that was not scaled
    (`loss_scaled` False: neither `get_scaled_loss` nor `scale_loss` was
    ever called) or that were not unscaled. Runs in Python, so inside a
    `tf.function` it warns when tracing."""
    if loss_scaled and gradients_unscaled:
        return
    if not loss_scaled and not gradients_unscaled:
        forgot = ("You forgot to call LossScaleOptimizer.get_scaled_loss() "
                  "and LossScaleOptimizer.get_unscaled_gradients() before "
                  "calling LossScaleOptimizer.apply_gradients(): the "
                  "gradients are applied as given, without loss scaling")
    elif not loss_scaled:
        forgot = ("You forgot to call LossScaleOptimizer.get_scaled_loss() "
                  "before calling LossScaleOptimizer.apply_gradients() (you "
                  "did call get_unscaled_gradients()): the gradients were "
                  "divided by a scale the loss was never multiplied by")
    else:
        # After scale_loss the wrapper unscales them itself; after
        # get_scaled_loss alone it has raised (check_unscaled).
        return
    tf.compat.v1.logging.warning(
        f"{forgot}. This will likely result in worse model quality. For "
        f"example:{_EXAMPLE}")
