"""The passes of a float16 diagnosis over its batches, and their figures.

Per batch, in every replica: the float32 twin's forward and backward pass at
scale 1, then the model's own at each probed scale, each reduced to a few
figures per layer and per variable (maxima, finiteness flags, underflow
counts against the twin's gradients). The replicas' figures are combined
(counts summed, the rest maxima), then the batches' into rows.
"""

import numpy as np
import tensorflow as tf

from tf_lossscale.diagnosis import advice
from tf_lossscale.diagnosis import models
from tf_lossscale.ops import float16

# Figures summed over replicas; the others are their maxima.
_SUMMED = ("underflow", "nonzero")


class Passes:
    """The two runs of `model` over its batches, under its strategy, with
    `loss_fn`: `(y_true, y_pred) -> per-example losses`."""

    def __init__(self, model, loss_fn):
        self._loss_fn = loss_fn
        self._tf_keras = models.keras_module(model).__name__ == "tf_keras"
        self._strategy = model.distribute_strategy
        self._probe = models.probe(model)
        self._twin = models.rebuilt(model)
        self._twin_probe = models.probe(self._twin)
        self._layers = models.probed_layers(model)
        self._variables = list(model.trainable_variables)
        owner = float16.owners(model)
        self._variable_layers = [owner.get(id(v)) for v in self._variables]
        self._float16_layer = [layer.compute_dtype == "float16"
                               for layer in self._layers]
        half = {id(v) for v in float16.float16_variables(model)}
        self._float16_variable = [id(v) in half for v in self._variables]
        # One trace each (per batch shape), run in every replica.
        self._float32_fn = tf.function(
            lambda batch: self._replicated(self._float32_pass, batch),
            reduce_retracing=True)
        self._float16_fn = tf.function(
            lambda batch, scale, float32_grads: self._replicated(
                self._float16_pass, batch, scale, float32_grads)[0],
            reduce_retracing=True)

    def _loss(self, y, y_pred, sample_weight):
        # In the dtype fit computes it in: Keras 3's losses cast the outputs
        # to float32, tf-keras' compute in the outputs' dtype.
        if not self._tf_keras:
            y_pred = tf.cast(y_pred, tf.float32)
        values = self._loss_fn(y, y_pred)
        if sample_weight is not None:
            weight = tf.cast(sample_weight, values.dtype)
            weight = tf.reshape(weight, tf.concat(
                [tf.shape(weight), tf.ones([tf.rank(values) - tf.rank(weight)],
                                           tf.int32)], axis=0))
            values = values * weight
        loss = tf.reduce_sum(values) / tf.cast(tf.size(values), values.dtype)
        # Each replica's share of the batch, as Keras' fit scales it, so the
        # replicas' gradients sum to the whole batch's.
        return loss * (
            1.0 / tf.distribute.get_replica_context().num_replicas_in_sync)

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

    def _float32_pass(self, batch):
        layer_outputs, output_grads, grads = self._forward_backward(
            self._twin_probe, self._twin.trainable_variables, batch, 1.0)
        return {
            "activation_max_float32": _per_item(layer_outputs),
            "gradient_max": _per_item(output_grads),
            "gradient_reached": tf.stack([
                tf.constant(float(any(g is not None for g in tensors)))
                for tensors in output_grads]),
            "variable_gradient_max": _per_item(grads),
        }, [tf.zeros(v.shape, tf.float32) if g is None else g
            for g, v in zip(grads, self._variables)]

    def _float16_pass(self, batch, scale, float32_grads):
        layer_outputs, output_grads, grads = self._forward_backward(
            self._probe, self._variables, batch, scale)
        known = tf.cast(float16.is_finite(batch[0]), tf.float32)
        output_finite = _per_item(layer_outputs, float16.is_finite)
        backward = [g for g, f16 in zip(output_grads + grads,
                                        self._float16_layer
                                        + self._float16_variable) if f16]
        forward_finite = tf.reduce_all(tf.cast(output_finite, tf.bool))
        # Underflow is counted where the float16 run is finite up to the
        # loss: a batch that overflowed forward has no gradients to compare.
        measured = known * tf.cast(forward_finite, tf.float32)
        return {
            "input_nonfinite": 1.0 - known[None],
            # Only batches with finite inputs say where non-finite values
            # start.
            "output_nonfinite": (1.0 - output_finite) * known,
            "forward_nonfinite": (1.0 - tf.cast(
                forward_finite, tf.float32))[None] * known,
            "activation_max": _per_item(layer_outputs),
            "backward_overflow": tf.cast(tf.logical_and(
                forward_finite, tf.logical_not(
                    float16.is_finite(backward))), tf.float32)[None],
            "variable_nonfinite": 1.0 - _per_item(grads, float16.is_finite),
            "underflow": measured * tf.stack([
                float16.underflow_count(g, reference) if f16 and (
                    g is not None) else tf.constant(0.0)
                for g, reference, f16 in zip(grads, float32_grads,
                                             self._float16_variable)]),
            "nonzero": measured * _per_item(
                float32_grads, float16.nonzero_count),
        }, None

    def _replicated(self, fn, *args):
        """`fn(*args)` in every replica: its figures combined over the
        replicas, its other output per replica."""

        def in_replica(*args):
            figures, rest = fn(*args)
            return {key: value[None] for key, value in figures.items()}, rest

        figures, rest = self._strategy.run(in_replica, args=args)
        return {key: (tf.reduce_sum if key in _SUMMED else tf.reduce_max)(
            self._strategy.gather(value, axis=0), axis=0)
                for key, value in figures.items()}, rest

    def _distribute(self, batch):
        """The batch as each replica's part of it (the batch itself without
        a strategy)."""
        replicas = self._strategy.num_replicas_in_sync
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

    def figures(self, batches, scales):
        """The figures of `batches` at `scales`: counts of batches, and one
        row per layer and per variable (see `Float16Diagnosis.as_dict`).
        Reads a few numbers back to the host after every pass."""
        float32_runs, float16_runs = [], []
        for batch in batches:
            distributed = self._distribute(batch)
            figures, float32_grads = self._float32_fn(distributed)
            float32_runs.append(figures)
            float16_runs.append([self._float16_fn(
                distributed, tf.constant(scale, tf.float32), float32_grads)
                for scale in scales])
        # Over the batches: maxima of the float32 figures and of the
        # outputs, counts of the rest; per scale ([scale, ...]).
        f32 = {key: np.max([run[key] for run in float32_runs], axis=0)
               for key in float32_runs[0]}
        f16 = {key: (np.max if key == "activation_max" else np.sum)(
            [[run[key] for run in runs] for runs in float16_runs], axis=0)
               for key in float16_runs[0][0]}
        counts = {
            "batches": len(batches),
            "replicas": self._strategy.num_replicas_in_sync,
            "input_nonfinite_batches": int(f16["input_nonfinite"][0, 0]),
            "forward_nonfinite_batches": int(f16["forward_nonfinite"][0, 0]),
            "overflow_batches": [
                int(n) for n in f16["backward_overflow"][:, 0]],
        }
        return dict(counts, layers=self._layer_rows(f32, f16),
                    variables=self._variable_rows(
                        f32, f16, advice.measured_batches(counts) > 0))

    def _layer_rows(self, f32, f16):
        # Against float16's range only where float16 holds the values.
        gradients = [value if reached else None for value, reached in zip(
            f32["gradient_max"].tolist(), f32["gradient_reached"])]
        return [{
            "name": layer.name,
            "compute_dtype": layer.compute_dtype,
            "activation_max": float(f16["activation_max"][0, index]),
            "activation_max_float32": largest,
            "activation_headroom_log2": (
                float16.headroom_log2(largest) if half else None),
            "gradient_max": gradient,
            "gradient_headroom_log2": (
                float16.headroom_log2(gradient) if half else None),
            "nonfinite_batches": int(f16["output_nonfinite"][0, index]),
        } for index, (layer, half, largest, gradient) in enumerate(zip(
            self._layers, self._float16_layer,
            f32["activation_max_float32"].tolist(), gradients))]

    def _variable_rows(self, f32, f16, measured):
        return [{
            # A Keras 3 variable's path, or a tf-keras variable's name.
            "name": getattr(variable, "path", None) or variable.name,
            "layer": None if layer is None else layer.name,
            "compute_dtype": "float16" if half else "float32",
            "size": int(np.prod(variable.shape)),
            "gradient_max": largest,
            "gradient_headroom_log2": (
                float16.headroom_log2(largest) if half else None),
            "nonzero_values": int(count),
            "underflow_share": [
                float(lost) / count if count else 0.0
                for lost in f16["underflow"][:, index]
            ] if half and measured else None,
            "nonfinite_batches": [
                int(n) for n in f16["variable_nonfinite"][:, index]],
        } for index, (variable, layer, half, largest, count) in enumerate(zip(
            self._variables, self._variable_layers, self._float16_variable,
            f32["variable_gradient_max"].tolist(),
            f16["nonzero"][0].tolist()))]


def _per_item(items, fn=float16.largest_magnitude):
    """`fn` of each item (a tensor or a list of them; by default its largest
    magnitude) as a float32 vector."""
    return tf.stack([tf.cast(fn(item), tf.float32) for item in items])
