"""What a tf-keras `LossScaleOptimizer`'s state is, and how files hold it."""

import tensorflow as tf


class SavedState:
    """Mixin of both tf-keras wrapper classes, as tf-keras' wrapper saves:
    `variables` (and the legacy `weights`) are the inner optimizer's, then
    the loss scale's, then the wrapper's own (`skipped_steps`, the overflow
    flags), which `.h5` and `.keras` files store in that order. The class
    gives `_inner_variables()`, `_loss_scale`, `_skipped_steps` and
    `_last_nonfinite`."""

    def _all_variables(self):
        """The inner optimizer's variables, the scale's, the wrapper's."""
        own = [self._skipped_steps] + (
            [] if self._last_nonfinite is None else [self._last_nonfinite])
        return (list(self._inner_variables())
                + list(self._loss_scale.variables) + own)

    def get_weights(self):
        return [variable.numpy() for variable in self._all_variables()]

    def set_weights(self, weights):
        """Sets `variables` (.h5 files), or nothing if the loss scale's
        values cannot be assigned exactly (`LossScale.check_loadable`)."""
        variables = self._all_variables()
        if len(weights) != len(variables):
            raise ValueError(f"LossScaleOptimizer has {len(variables)} "
                             f"variables, got {len(weights)} values: build it "
                             "first (optimizer.build(variables))")
        first = len(self._inner_variables())
        self._loss_scale.check_loadable(
            weights[first:first + len(self._loss_scale.variables)])
        for variable, value in zip(variables, weights):
            variable.assign(value)

    def save_own_variables(self, store):
        """`.keras` files: the values of `variables`, under "0", "1", ..."""
        for index, value in enumerate(self.get_weights()):
            store[str(index)] = value

    def load_own_variables(self, store):
        """Restores `save_own_variables`, or nothing if built unlike the saved
        optimizer (as tf-keras does)."""
        if len(store.keys()) != len(self._all_variables()):
            tf.get_logger().warning(
                f"Skipping variable loading for optimizer '{self.name}': it "
                f"has {len(self._all_variables())} variables, the saved one "
                f"{len(store.keys())}. Build it first.")
            return
        self.set_weights([store[str(i)] for i in range(len(store.keys()))])
