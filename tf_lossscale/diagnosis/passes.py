"""The passes of a float16 diagnosis over one batch, and their totals.

`Passes.batch` runs, in every replica of the model's strategy, the float32
twin's forward and backward pass at scale 1, then the model's own (float16)
forward and backward pass at each probed scale, and reduces each to a few
figures per layer and per variable (`gradient_stats`): maxima, finiteness
flags, underflow counts against the twin's gradients of the same batch. The
replicas' figures are gathered and combined (maxima over replicas, counts
summed); `Totals` combines the batches'. `tf_lossscale.diagnosis` says what
the figures mean.
"""

import numpy as np
import tensorflow as tf

from tf_lossscale.diagnosis import models
from tf_lossscale.ops import float16
from tf_lossscale.ops import float16


class Passes:
    """The model's two runs over one batch, under its strategy.

    Args:
      model: the model (see `diagnose`).
      loss_fn: `(y_true, y_pred) -> per-example losses`.
    """

    def __init__(self, model, loss_fn):
        self._loss_fn = loss_fn
        self._strategy = model.distribute_strategy
        self.replicas = self._strategy.num_replicas_in_sync
        self._probe = models.probe(model)
        self._twin = models.float32_twin(model)
        self._twin_probe = models.probe(self._twin)
        self._layers = models.probed_layers(model)
        owner = float16.owners(model)
        self._variables = list(model.trainable_variables)
        self._variable_layers = [owner.get(id(v)) for v in self._variables]
        self._float16_layer = [
            float16.compute_dtype(layer) == "float16"
            for layer in self._layers]
        self._float16_variable = [
            layer is not None
            and float16.compute_dtype(layer) == "float16"
            and not float16.takes_gradient_as_value(variable)
            for variable, layer in zip(self._variables,
                                       self._variable_layers)]
        # One trace each (per batch shape), run in every replica.
        self._float32_fn = tf.function(
            lambda batch: self._replicated(self._float32_pass, batch),
            reduce_retracing=True)
        self._float16_fn = tf.function(
            lambda batch, scale, float32_grads: self._replicated(
                self._float16_pass, batch, scale, float32_grads)[0],
            reduce_retracing=True)

    def layer_rows(self):
        return [{"name": layer.name,
                 "compute_dtype": float16.compute_dtype(layer)}
                for layer in self._layers]

    def variable_rows(self):
        return [{"name": float16.variable_name(variable),
                 "layer": None if layer is None else layer.name,
                 "compute_dtype": ("float16" if is_float16 else "float32"),
                 "size": int(np.prod(variable.shape))}
                for variable, layer, is_float16 in zip(
                    self._variables, self._variable_layers,
                    self._float16_variable)]

    # The loss, per replica.

    def _loss(self, y, y_pred, sample_weight):
        values = tf.cast(self._loss_fn(y, tf.cast(y_pred, tf.float32)),
                         tf.float32)
        if sample_weight is not None:
            weight = tf.cast(sample_weight, tf.float32)
            weight = tf.reshape(weight, tf.concat(
                [tf.shape(weight), tf.ones([tf.rank(values) - tf.rank(weight)],
                                           tf.int32)], axis=0))
            values = values * weight
        loss = tf.reduce_sum(values) / tf.cast(tf.size(values), tf.float32)
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        if replicas > 1:
            # Each replica's share of the batch, as Keras' fit scales it, so
            # the replicas' gradients sum to the whole batch's.
            loss = loss * (1.0 / replicas)
        return loss

    def _forward_backward(self, probe, variables, batch, scale):
        x, y, sample_weight = batch
        with tf.GradientTape() as tape:
            layer_outputs, y_pred = probe(x)
            loss = self._loss(y, y_pred, sample_weight)
            scaled = loss * tf.cast(scale, loss.dtype)
        grads = tape.gradient(scaled, (layer_outputs, list(variables)))
        # Sparse gradients (embeddings) made dense, to compare position by
        # position; rows absent from the batch are 0 in both runs.
        return layer_outputs, grads[0], [
            tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            for g in grads[1]]

    # Each replica's figures: float32 vectors, combined over replicas by
    # `_combine` (max for "max" and "flag" figures, sum for counts).

    def _float32_pass(self, batch):
        layer_outputs, output_grads, grads = self._forward_backward(
            self._twin_probe, self._twin.trainable_variables, batch, 1.0)
        figures = {
            "max:activation_max_float32": _per_item(
                float16.largest_magnitude, layer_outputs),
            "max:gradient_max": _per_item(_largest_or_zero, output_grads),
            "flag:gradient_reached": tf.stack([
                tf.constant(float(any(g is not None for g in tensors)))
                for tensors in output_grads]),
            "max:variable_gradient_max": _per_item(_largest_or_zero, grads),
        }
        return figures, [tf.zeros(v.shape, tf.float32) if g is None else g
                         for g, v in zip(grads, self._variables)]

    def _float16_pass(self, batch, scale, float32_grads):
        x = batch[0]
        layer_outputs, output_grads, grads = self._forward_backward(
            self._probe, self._variables, batch, scale)
        input_finite = float16.is_finite(x)
        known = tf.cast(input_finite, tf.float32)
        output_finite = _per_item(_finite, layer_outputs)
        backward = [g for g, f16 in zip(output_grads, self._float16_layer)
                    if f16] + [g for g, f16 in zip(grads,
                                                   self._float16_variable)
                               if f16]
        forward_finite = tf.reduce_all(tf.cast(output_finite, tf.bool))
        # Underflow is counted where the float16 run is finite up to the
        # loss: a batch that overflowed forward has no gradients to compare.
        measured = known * tf.cast(forward_finite, tf.float32)
        return {
            "max:input_nonfinite": 1.0 - known[None],
            # Only batches with finite inputs say where non-finite values
            # start.
            "max:output_nonfinite": (1.0 - output_finite) * known,
            "max:forward_nonfinite": (1.0 - tf.cast(
                forward_finite, tf.float32))[None] * known,
            "max:activation_max": _per_item(
                float16.largest_magnitude, layer_outputs),
            "max:backward_overflow": tf.cast(tf.logical_and(
                forward_finite, tf.logical_not(
                    float16.is_finite(backward))), tf.float32)[None],
            "max:variable_nonfinite": 1.0 - _per_item(_finite, grads),
            "sum:underflow": measured * tf.stack([
                float16.underflow_count(g, reference) if f16 and (
                    g is not None) else tf.constant(0.0)
                for g, reference, f16 in zip(grads, float32_grads,
                                             self._float16_variable)]),
            "sum:nonzero": measured * _per_item(
                float16.nonzero_count, float32_grads),
        }

    def _replicated(self, fn, *args):
        """`fn(*args)` in every replica; its figures gathered and combined;
        other outputs stay per replica."""

        def in_replica(*args):
            result = fn(*args)
            figures, rest = (result if isinstance(result, tuple)
                             else (result, None))
            return {key: value[None] for key, value in figures.items()}, rest

        figures, rest = self._strategy.run(in_replica, args=args)
        return {key: _combine(key, self._strategy.gather(value, axis=0))
                for key, value in figures.items()}, rest

    def batch(self, batch, scales):
        """The figures of one batch: the float32 pass's, and the float16
        pass's at each scale."""
        distributed = self._distribute(batch)
        float32_figures, float32_grads = self._float32_fn(distributed)
        float16_figures = [
            self._float16_fn(distributed, tf.constant(scale, tf.float32),
                             float32_grads)
            for scale in scales]
        return _to_numpy(float32_figures), [_to_numpy(figures)
                                            for figures in float16_figures]

    def _distribute(self, batch):
        """The batch as each replica's part of it (the batch itself without
        a strategy)."""
        replicas = self.replicas
        if replicas == 1:
            return batch
        size = int(tf.nest.flatten(batch[0])[0].shape[0])
        if size % replicas:
            raise ValueError(
                f"a batch of {size} examples does not split evenly over "
                f"{replicas} replicas")
        part = size // replicas

        def replica_part(context):
            start = context.replica_id_in_sync_group * part
            return tf.nest.map_structure(
                lambda t: None if t is None else (
                    tf.convert_to_tensor(t)[start:start + part]), batch)

        return self._strategy.experimental_distribute_values_from_function(
            replica_part)


def _per_item(fn, items):
    """`fn` of each item (a tensor or a list of them) as a float32 vector."""
    return tf.stack([tf.cast(fn(item), tf.float32) for item in items])


def _present(tensors):
    return [t for t in tf.nest.flatten(tensors) if t is not None]


def _largest_or_zero(tensors):
    return float16.largest_magnitude(_present(tensors))


def _finite(tensors):
    return tf.cast(float16.is_finite(_present(tensors)), tf.float32)


def _combine(key, gathered):
    """Replicas' figures (stacked on axis 0) -> one figure."""
    if key.startswith("sum:"):
        return tf.reduce_sum(gathered, axis=0)
    return tf.reduce_max(gathered, axis=0)


def _to_numpy(figures):
    return {key.split(":", 1)[1]: np.asarray(value)
            for key, value in figures.items()}


class Totals:
    """The batches' figures, combined: maxima over batches, counts of the
    batches a flag was set on, and sums."""

    def __init__(self, num_scales):
        self._float32 = []
        self._float16 = [[] for _ in range(num_scales)]

    def add(self, batch_figures):
        float32_figures, float16_figures = batch_figures
        self._float32.append(float32_figures)
        for per_scale, figures in zip(self._float16, float16_figures):
            per_scale.append(figures)

    def totals(self):
        def stacked(rows, key):
            return np.stack([row[key] for row in rows])

        first_scale = self._float16[0]
        return {
            "activation_max": stacked(first_scale, "activation_max").max(0),
            "activation_max_float32": stacked(
                self._float32, "activation_max_float32").max(0),
            "gradient_max": stacked(self._float32, "gradient_max").max(0),
            "gradient_reached": stacked(
                self._float32, "gradient_reached").max(0) > 0,
            "output_nonfinite_batches": stacked(
                first_scale, "output_nonfinite").sum(0).astype(int),
            "input_nonfinite_batches": int(stacked(
                first_scale, "input_nonfinite").sum()),
            "forward_nonfinite_batches": int(stacked(
                first_scale, "forward_nonfinite").sum()),
            "variable_gradient_max": stacked(
                self._float32, "variable_gradient_max").max(0),
            "nonzero": stacked(first_scale, "nonzero").sum(0),
            "underflow": np.stack([stacked(rows, "underflow").sum(0)
                                   for rows in self._float16]),
            "overflow_batches": np.array([
                int(stacked(rows, "backward_overflow").sum())
                for rows in self._float16]),
            "variable_nonfinite_batches": np.stack([
                stacked(rows, "variable_nonfinite").sum(0).astype(int)
                for rows in self._float16]),
        }
