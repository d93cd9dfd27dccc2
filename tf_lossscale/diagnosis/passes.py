"""The passes of a float16 diagnosis over its batches, and their figures.

Per batch, in every replica: the float32 twin's forward and backward pass at
scale 1, then the float16 copy's at each probed scale up to the first that
overflows, each reduced in few ops to a few figures per layer and per
variable; the replicas' figures are combined (counts and squares summed, the
rest maxima), then the batches' into rows
(docs/guides/float16-troubleshooting.md).
"""

import math

import numpy as np
import tensorflow as tf

from tf_lossscale.diagnosis import models
from tf_lossscale.ops import float16

# Figures summed over replicas; the others are their maxima.
_SUMMED = ("underflow", "nonzero", "lost_squares", "reference_squares")
# The float16 figures of the backward pass; the others are the forward's.
_BACKWARD = ("backward_overflow", "variable_nonfinite", "underflow",
             "lost_squares")


class Passes:
    """The two runs of `model` over its batches, under its strategy, with
    `loss_fn`: `(y_true, y_pred) -> per-example losses`. `training`: run the
    layers as `fit` does (normalization on batch statistics), or as
    `predict` does. The model itself never runs: copies of it do.

    What `rows.py` reads: `replicas`; per leaf layer `layer_paths` and
    `layer_dtypes`, and, once traced, `called` (the indices of those that
    ran, in order) and `reached` (whether the loss reached their outputs);
    per trainable variable `variables` (the model's), `variable_layers`
    (their leaf paths) and `float16_variable` (whether measured as float16).
    """

    def __init__(self, model, loss_fn, training=True):
        self._loss_fn = loss_fn
        self._training = training
        self._tf_keras = models.keras_module(model).__name__ == "tf_keras"
        self._strategy = model.distribute_strategy
        self.replicas = self._strategy.num_replicas_in_sync
        self._twin = models.copy(model, models.ALL)
        self._copy = models.copy(model)
        for copied in (self._twin, self._copy):
            models.random_layers_off(copied)
        self._twin_recorder = models.Recorder(self._twin)
        self._recorder = models.Recorder(self._copy)
        self.layer_paths = [path for path, _ in self._recorder.leaves]
        # The model's variables name the rows; the copy's are measured.
        self.variables = list(model.trainable_variables)
        self._ids = float16.variable_ids(self.variables)
        holders = models.variable_holders(self._copy)
        copied = self._copy.trainable_variables
        self.variable_layers = [holders.get(id(v), (None,))[0]
                                for v in copied]
        self.float16_variable = [
            id(v) in holders and holders[id(v)][1].compute_dtype == "float16"
            and not float16.takes_gradient_as_value(v) for v in copied]
        self.layer_dtypes = [layer.compute_dtype
                             for _, layer in self._recorder.leaves]
        # Set while tracing.
        self.called = None
        self.reached = None
        self._float32_fn = tf.function(
            lambda batch: self._replicated(self._float32_pass, batch),
            reduce_retracing=True)
        self._float16_fn = tf.function(
            lambda batch, scale, float32_flat: self._replicated(
                self._float16_pass, batch, scale, float32_flat)[0],
            reduce_retracing=True)

    def _loss(self, model, y, y_pred, sample_weight):
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
        # Regularization, as fit adds it.
        extra = [tf.cast(tf.reduce_sum(v), loss.dtype) for v in model.losses]
        if extra:
            loss = loss + tf.add_n(extra)
        # Each replica's share of the batch, as Keras' fit scales it, so the
        # replicas' gradients sum to the whole batch's.
        return loss * (
            1.0 / tf.distribute.get_replica_context().num_replicas_in_sync)

    def _forward(self, model, recorder, batch):
        x, y, sample_weight = batch
        with recorder.recording() as records:
            y_pred = model(x, training=self._training)
        return records, self._loss(model, y, y_pred, sample_weight)

    def _by_layer(self, records, tensor_lists, finite=False):
        """Float32 vectors over the model's leaf layers, from `tensor_lists`
        (one list per record: its outputs, or their gradients; None
        skipped): the largest |value| (+inf for +-Inf), and with `finite`
        1.0 where every value is finite. A layer that did not run, or whose
        tensors are all None, gets 0 (and 1)."""
        indices, largest, finiteness = [], [], []
        for (index, _), tensors in zip(records, tensor_lists):
            for tensor in tensors:
                if tensor is not None:
                    indices.append(index)
                    # Per tensor: one reduction over it, no copy of it.
                    largest.append(tf.reduce_max(tf.abs(tf.cast(
                        tensor, tf.float32))))
                    if finite:
                        finiteness.append(tf.cast(tf.reduce_all(
                            tf.math.is_finite(tensor)), tf.float32))
        count = len(self.layer_paths)
        if not indices:
            return tf.zeros([count]), tf.ones([count])
        by_layer = [tf.maximum(tf.math.unsorted_segment_max(
            tf.stack(largest), indices, count), 0.0)]
        if finite:
            by_layer.append(tf.minimum(tf.math.unsorted_segment_min(
                tf.stack(finiteness), indices, count), 1.0))
            by_layer[0] = tf.where(by_layer[1] == 1.0, by_layer[0], math.inf)
        return tuple(by_layer)

    def _float32_pass(self, batch):
        with tf.GradientTape() as tape:
            records, loss = self._forward(self._twin, self._twin_recorder,
                                          batch)
        variables = list(self._twin.trainable_variables)
        output_grads, grads = tape.gradient(
            loss, ([tensors for _, tensors in records], variables))
        self.reached = [False] * len(self.layer_paths)
        for (index, _), tensors in zip(records, output_grads):
            self.reached[index] |= any(g is not None for g in tensors)
        flat = float16.flatten(grads, variables)
        return {
            "activation_max_float32": self._by_layer(
                records, [tensors for _, tensors in records])[0],
            "gradient_max": self._by_layer(records, output_grads)[0],
            "variable_gradient_max": float16.largest_by_variable(
                flat, self._ids, len(variables)),
        }, flat

    def _float16_pass(self, batch, scale, float32_flat):
        with tf.GradientTape() as tape:
            records, loss = self._forward(self._copy, self._recorder, batch)
        # In the order they first ran.
        self.called = list(dict.fromkeys(index for index, _ in records))
        variables = list(self._copy.trainable_variables)
        count, ids = len(variables), self._ids
        half = tf.constant(self.float16_variable, tf.float32)
        outputs = [tensors for _, tensors in records]
        known = tf.cast(float16.is_finite(batch[0]), tf.float32)
        activation_max, output_finite = self._by_layer(records, outputs,
                                                       finite=True)
        forward_finite = tf.logical_and(
            tf.reduce_all(output_finite == 1.0), float16.is_finite(loss))
        # Underflow is counted in float16 variables where the float16 run is
        # finite up to the loss: a batch that overflowed forward has no
        # gradients to compare.
        measured = known * tf.cast(forward_finite, tf.float32) * half
        measured64 = tf.cast(measured, tf.float64)
        records_half = [record for record in records
                        if self.layer_dtypes[record[0]] == "float16"]
        half_outputs = [tensors for _, tensors in records_half]
        figures = {
            "input_nonfinite": 1.0 - known[None],
            # Only batches with finite inputs say where non-finite values
            # start.
            "output_nonfinite": (1.0 - output_finite) * known,
            "forward_nonfinite": (1.0 - tf.cast(
                forward_finite, tf.float32))[None] * known,
            "activation_max": activation_max,
            "nonzero": measured * float16.nonzero_by_variable(
                float32_flat, ids, count),
            "reference_squares": measured64 * float16.squares_by_variable(
                float32_flat, ids, count),
        }
        # Seeding the backward pass with the scale is differentiating the
        # scaled loss (d(s * loss)/d loss = s): the same values.
        output_grads, grads = tape.gradient(
            loss, (half_outputs, variables),
            output_gradients=tf.cast(scale, loss.dtype))
        flat = float16.flatten(grads, variables)
        nonfinite = float16.nonfinite_by_variable(flat, ids, count)
        underflow, lost_squares = float16.underflow_by_variable(
            flat, float32_flat, scale, ids, count)
        backward_finite = tf.logical_and(
            tf.reduce_all(self._by_layer(records_half, output_grads,
                                         finite=True)[1] == 1.0),
            tf.reduce_max(nonfinite * half) == 0.0)
        figures.update(
            backward_overflow=tf.cast(tf.logical_and(
                forward_finite, tf.logical_not(backward_finite)),
                                      tf.float32)[None],
            variable_nonfinite=nonfinite,
            underflow=measured * underflow,
            lost_squares=measured64 * lost_squares)
        return figures, None

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

    def run_batch(self, batch, scales, progress):
        """The figures of one batch: `(float32 figures, float16 figures)`,
        the float16 backward pass's with one row per scale. Reads a few
        numbers back to the host after every pass, to stop at the first
        scale that overflows."""
        distributed = self._distribute(batch)
        figures32, float32_flat = self._float32_fn(distributed)
        progress.advance()
        rows = []
        for scale in scales:
            rows.append({key: np.asarray(value) for key, value in
                         self._float16_fn(distributed, tf.constant(
                             scale, tf.float32), float32_flat).items()})
            progress.advance()
            if any(rows[-1][key][0] for key in ("input_nonfinite",
                                                 "forward_nonfinite",
                                                 "backward_overflow")):
                break
        progress.advance(len(scales) - len(rows))
        # Scales not run repeat the last one run: a larger scale only makes
        # every value larger, so they overflow too.
        rows += rows[-1:] * (len(scales) - len(rows))
        # The forward pass is the same at every scale.
        return ({key: np.asarray(value) for key, value in figures32.items()},
                {key: np.stack([row[key] for row in rows])
                 if key in _BACKWARD else value
                 for key, value in rows[0].items()})
