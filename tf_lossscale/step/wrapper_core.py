"""What every LossScaleOptimizer wrapper (Keras 3, tf-keras, TF1) does the
same way around the shared step (`tf_lossscale.step.loss_scaled_step`): the
opening of a step, and the overflow report.

* `open_step()`: the checks before anything else in `apply_gradients`: a
  replica context (`checks.ReplicaContextError`, one message for every
  wrapper), then a strategy loss scaling can serve;
* `skip_record(...)`: what a skipped step writes (`loss_scaled_step.
  SkipRecord`), built the same way by both Keras wrappers;
* `nonfinite_paths(variables, flags)`: what `last_nonfinite_variables()`
  returns, the same kind of string from every Keras: a variable's path,
  `variable.path` under Keras 3, and under tf-keras its name without the
  `:0` output suffix (for a functional model the two are equal; Keras 3
  adds the model's name in front for Sequential and subclassed models).
"""

import re

import tensorflow as tf

from tf_lossscale.ops import replicas
from tf_lossscale.step import loss_scaled_step
from tf_lossscale._internal import checks

_OUTPUT_SUFFIX = re.compile(r":\d+$")


def check_replica_context():
    """Raises `checks.ReplicaContextError` in a strategy's cross-replica
    context: a step must run inside `strategy.run` (or `fit`), or with no
    strategy at all."""
    if tf.distribute.has_strategy() and (
            tf.distribute.in_cross_replica_context()):
        raise checks.ReplicaContextError(
            "LossScaleOptimizer.apply_gradients must be called in a "
            "replica context: inside strategy.run (or model.fit, or the "
            "strategy's call_for_each_replica), not directly under "
            "strategy.scope()")


def open_step(check_strategy=replicas.check_supported):
    """The opening checks of every wrapper's step, before anything changes.

    Args:
      check_strategy: raises for a strategy loss scaling cannot serve (the
        tf-keras wrapper passes one raising tf-keras' exception types).

    Raises:
      checks.ReplicaContextError: called in cross-replica context.
      ValueError: a strategy loss scaling cannot serve.
    """
    check_replica_context()
    check_strategy()


def skip_record(skipped_steps, flags, built_for, position_of):
    """The `loss_scaled_step.SkipRecord` of a Keras wrapper.

    Args:
      skipped_steps: the wrapper's int64 count of skipped steps.
      flags: its int32 vector of overflow flags, one per variable of
        `built_for`.
      built_for: the variables the wrapper was built with, in order.
      position_of: a variable's position in `built_for`, for whichever
        replica's component a step hands over.
    """
    return loss_scaled_step.SkipRecord(
        skipped_steps, flags,
        lambda variables: [position_of(v) for v in variables or built_for])


def variable_path(variable):
    """A variable's path: Keras 3's `path`, or else its name without the
    `:0` output suffix TensorFlow variables' names carry."""
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    return _OUTPUT_SUFFIX.sub("", variable.name)


def nonfinite_paths(variables, flags):
    """Paths of `variables` whose flag in `flags` (an int32 vector variable
    holding one per variable, or None) is set, in order.

    Syncs device and host: reads the flags.
    """
    if flags is None:
        return []
    return [variable_path(variable)
            for variable, flag in zip(variables, flags.numpy()) if flag]
