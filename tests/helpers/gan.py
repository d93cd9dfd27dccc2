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
            images, noise_d, noise_g, poison = (data[key] for key in (
                "images", "noise_d", "noise_g", "poison"))
            loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
            batch = tf.shape(images)[0]
            fake = tf.cast(self.generator(noise_d), images.dtype)
            combined = tf.concat([fake, images], axis=0)
            labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))],
                               axis=0)
            d_weights = self.discriminator.trainable_weights
            with tf.GradientTape() as tape:
                d_loss = loss_fn(labels, self.discriminator(combined))
                scaled = _scaled(self.d_optimizer, d_loss)
            grads = tape.gradient(scaled, d_weights)
            self.d_optimizer.apply_gradients(zip(grads, d_weights))

            g_weights = self.generator.trainable_weights
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(noise_g))
                g_loss = loss_fn(tf.zeros((batch, 1)), predictions)
                scaled = _scaled(self.g_optimizer, g_loss)
            grads = tape.gradient(scaled, g_weights)
            # 0.0 exactly, or NaN: poisons this optimizer's gradients only.
            planted = tf.reduce_sum(poison)
            grads = [g + tf.cast(planted, g.dtype) for g in grads]
            self.g_optimizer.apply_gradients(zip(grads, g_weights))
            return {"d_loss": d_loss, "g_loss": g_loss}

    return GAN


def build(keras, weights, block=None):
    """A GAN under the current dtype policy, set to `weights` (d, g)."""
    discriminator, generator = _discriminator(keras), _generator(keras)
    discriminator.set_weights(weights[0])
    generator.set_weights(weights[1])
    return gan_class(keras)(discriminator, generator, block=block)


def recorder(keras, optimizers):
    """A callback recording after each batch the logged losses, the loss
    scale (None for plain optimizers) and each optimizer's skipped steps."""

    class Recorder(keras.callbacks.Callback):

        def __init__(self):
            super().__init__()
            self.steps = []

        def on_train_batch_end(self, batch, logs=None):
            scale = getattr(optimizers[0], "loss_scale", None)
            self.steps.append({
                "d_loss": float(logs["d_loss"]),
                "g_loss": float(logs["g_loss"]),
                "scale": None if scale is None else float(scale()),
                "skipped": [int(getattr(o, "skipped_steps", 0))
                            for o in optimizers],
            })

    return Recorder()


def fit(keras, model, optimizers, arrays, batch_size, jit_compile=False,
        callbacks=()):
    """Compiles `model` with the two optimizers and fits it on `arrays` for
    one epoch; returns the recorded steps (`recorder`)."""
    model.compile(d_optimizer=optimizers[0], g_optimizer=optimizers[1],
                  jit_compile=jit_compile)
    record = recorder(keras, optimizers)
    model.fit(dataset(arrays, batch_size), epochs=1, verbose=0,
              callbacks=[*callbacks, record])
    return record.steps
