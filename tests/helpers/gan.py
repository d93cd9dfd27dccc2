"""A DCGAN-style model on 8x8 synthetic images: two optimizers, one loss scale.

The `train_step` is the one of Keras 3's DCGAN example (two optimizers, two
tapes; the discriminator steps first, the generator's loss goes through the
discriminator it just updated), with the loss scaling a custom step needs:
each optimizer's `scale_loss` in its tape (a plain optimizer's returns the
loss as it is, so the float32 run is the same code). Everything is fixed by
the data, drawn here with numpy: the real images, both steps' latent noise,
and a `poison` column, 0 or NaN per example, added (summed over the replica's
examples) to the generator's gradients only: a NaN planted in one optimizer's
gradients, on the replica that holds that example. No randomness in the step.

Imports no Keras: each function takes the `keras` in use (Keras 3's or
tf-keras), so the tf-keras scripts share it. `run` trains and records each
step's losses, the scale and each optimizer's skipped steps.
"""

import functools

import numpy as np
import tensorflow as tf

LATENT = 4
SIZE = 8


def data(batches, batch_size, poison_batches=(), seed=0):
    """`{"images", "noise_d", "noise_g", "poison"}`: arrays of
    `batches * batch_size` rows; the last example of each batch in
    `poison_batches` is poisoned (on the last replica, with a strategy)."""
    rng = np.random.default_rng(seed)
    rows = batches * batch_size
    # Soft blobs at random places: an image distribution a tiny GAN can fit.
    centres = rng.uniform(2, SIZE - 2, size=(rows, 2, 1, 1))
    grid = np.arange(SIZE, dtype=np.float64)
    images = np.exp(-((grid[None, :, None] - centres[:, 0]) ** 2
                      + (grid[None, None, :] - centres[:, 1]) ** 2) / 4.0)
    images = images[..., None].astype(np.float32)
    noise_d = rng.standard_normal((rows, LATENT)).astype(np.float32)
    noise_g = rng.standard_normal((rows, LATENT)).astype(np.float32)
    poison = np.zeros((rows,), np.float32)
    for batch in poison_batches:
        poison[(batch + 1) * batch_size - 1] = np.nan
    return {"images": images, "noise_d": noise_d, "noise_g": noise_g,
            "poison": poison}


def dataset(arrays, batch_size):
    return tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size)


def _generator(keras):
    return keras.Sequential([
        keras.Input((LATENT,)),
        keras.layers.Dense(4 * 4 * 8),
        keras.layers.Reshape((4, 4, 8)),
        keras.layers.Conv2DTranspose(8, 3, strides=2, padding="same"),
        keras.layers.LeakyReLU(),
        keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid",
                            dtype="float32"),
    ], name="generator")


def _discriminator(keras):
    return keras.Sequential([
        keras.Input((SIZE, SIZE, 1)),
        keras.layers.Conv2D(8, 3, strides=2, padding="same"),
        keras.layers.LeakyReLU(),
        keras.layers.Flatten(),
        keras.layers.Dense(1, dtype="float32"),
    ], name="discriminator")


def initial_weights(keras, seed=1):
    """The weights every run starts from (float32 arrays): (d, g)."""
    rng = np.random.default_rng(seed)

    def drawn(model):
        return [(rng.standard_normal(w.shape) * 0.3).astype(np.float32)
                for w in model.get_weights()]

    return drawn(_discriminator(keras)), drawn(_generator(keras))


def _scaled(optimizer, loss):
    scale_loss = getattr(optimizer, "scale_loss", None)
    return loss if scale_loss is None else scale_loss(loss)


@functools.lru_cache(maxsize=None)
def gan_class(keras):
    """The GAN model class for `keras` (Keras 3 or tf-keras)."""

    class GAN(keras.Model):
        """Keras 3's DCGAN example, as its `train_step`; `block` (a
        `LossScaleGroup` or None) makes both steps one `group.iteration()`
        block (the generator's loss then goes through the discriminator as
        it was, since the block applies both at its end)."""

        def __init__(self, discriminator, generator, block=None):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self._block = block

        def get_config(self):  # For `.keras` files.
            serialize = keras.saving.serialize_keras_object
            return {"discriminator": serialize(self.discriminator),
                    "generator": serialize(self.generator)}

        @classmethod
        def from_config(cls, config):
            deserialize = keras.saving.deserialize_keras_object
            return cls(deserialize(config["discriminator"]),
                       deserialize(config["generator"]))

        def compile(self, d_optimizer, g_optimizer, **kwargs):
            super().compile(**kwargs)
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer

        def call(self, data):
            # Keras 3 calls it on a batch to build the model under a strategy.
            return self.generator(data["noise_g"])

        def train_step(self, data):
            if self._block is None:
                return self._steps(data)
            with self._block.iteration():
                return self._steps(data)

        def _steps(self, data):
            if isinstance(data, tuple):  # train_on_batch's (x, y, weights).
                data = data[0]
            images, noise_d, noise_g, poison = (data[key] for key in (
                "images", "noise_d", "noise_g", "poison"))
            # Under a strategy the optimizers sum the replicas' gradients:
            # each replica differentiates its share of the global batch's
            # mean loss, and logs that mean, as one device would. The loss
            # is TensorFlow's (Keras 3's losses divide by the replicas
            # themselves, tf-keras' refuse to run under a strategy here).
            context = tf.distribute.get_replica_context()
            share = 1.0 / context.num_replicas_in_sync

            def loss_fn(labels, logits):
                return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                    labels=labels, logits=tf.cast(logits, tf.float32)))

            batch = tf.shape(images)[0]
            fake = tf.cast(self.generator(noise_d), images.dtype)
            combined = tf.concat([fake, images], axis=0)
            labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))],
                               axis=0)
            d_weights = self.discriminator.trainable_weights
            with tf.GradientTape() as tape:
                d_loss = loss_fn(labels, self.discriminator(combined))
                scaled = _scaled(self.d_optimizer, d_loss * share)
            grads = tape.gradient(scaled, d_weights)
            self.d_optimizer.apply_gradients(zip(grads, d_weights))

            g_weights = self.generator.trainable_weights
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(noise_g))
                g_loss = loss_fn(tf.zeros((batch, 1)), predictions)
                scaled = _scaled(self.g_optimizer, g_loss * share)
            grads = tape.gradient(scaled, g_weights)
            # 0.0 exactly, or NaN: poisons this optimizer's gradients only.
            planted = tf.reduce_sum(poison)
            grads = [g + tf.cast(planted, g.dtype) for g in grads]
            self.g_optimizer.apply_gradients(zip(grads, g_weights))
            mean = tf.distribute.ReduceOp.MEAN
            return {"d_loss": context.all_reduce(mean, d_loss),
                    "g_loss": context.all_reduce(mean, g_loss)}

    return GAN


def inner_optimizer(keras):
    """Each optimizer's: SGD with momentum, whose steps are proportional to
    the gradients (Adam's would hide a wrongly unscaled gradient) and whose
    slots make a wrongly applied skipped step visible later on."""
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.5)


def build(keras, weights, block=None):
    """A GAN under the current dtype policy, set to `weights` (d, g)."""
    discriminator, generator = _discriminator(keras), _generator(keras)
    discriminator.set_weights(weights[0])
    generator.set_weights(weights[1])
    model = gan_class(keras)(discriminator, generator, block=block)
    model({"noise_g": np.zeros((1, LATENT), np.float32)})  # Built, to save.
    if hasattr(model, "distribute_reduction_method"):
        # tf-keras sums the replicas' logs (Keras 3 averages them); the
        # step logs the mean every replica holds.
        model.distribute_reduction_method = "first"
    return model


def inner_values(optimizer):
    """The inner optimizer's variables' values (its step count and slots)."""
    variables = optimizer.inner_optimizer.variables
    return [np.array(v.numpy()) for v in (
        variables() if callable(variables) else variables)]


def recorder(keras, optimizers, snapshots=()):
    """A callback recording after each batch the logged losses, the loss
    scale (None for plain optimizers), each optimizer's skipped steps and
    the logs the monitor adds; after the batches in `snapshots`, copies of
    both models' weights and both inner optimizers' variables."""

    class Recorder(keras.callbacks.Callback):

        def __init__(self):
            super().__init__()
            self.steps = []

        def on_train_batch_end(self, batch, logs=None):
            scale = getattr(optimizers[0], "loss_scale", None)
            step = {
                "d_loss": float(logs["d_loss"]),
                "g_loss": float(logs["g_loss"]),
                "scale": None if scale is None else float(scale()),
                "skipped": [int(getattr(o, "skipped_steps", 0))
                            for o in optimizers],
                "logs": {key: logs[key] for key in logs
                         if key not in ("d_loss", "g_loss")},
            }
            if len(self.steps) in snapshots:
                step["values"] = {
                    "d": [np.array(w) for w in
                          self.model.discriminator.get_weights()],
                    "g": [np.array(w) for w in
                          self.model.generator.get_weights()],
                    "d_inner": inner_values(optimizers[0]),
                    "g_inner": inner_values(optimizers[1])}
            self.steps.append(step)

    return Recorder()


def fit(keras, model, optimizers, arrays, batch_size, jit_compile=False,
        callbacks=(), snapshots=()):
    """Compiles `model` with the two optimizers and fits it on `arrays` for
    one epoch; returns the recorded steps (`recorder`). Under a strategy,
    call it under its scope (compile makes Keras' own optimizer)."""
    model.compile(d_optimizer=optimizers[0], g_optimizer=optimizers[1],
                  jit_compile=jit_compile)
    record = recorder(keras, optimizers, snapshots)
    model.fit(dataset(arrays, batch_size), epochs=1, verbose=0,
              callbacks=[*callbacks, record])
    return record.steps
