"""tf-keras users' journeys, in a process where `tf.keras` is tf-keras.

This process imported Keras 3 first, so the journeys
(`tests/scripts/tf_keras_journeys.py`, each checking its results against
results computed in the same process) run in the session's tf-keras process
(`TF_USE_LEGACY_KERAS=1`), each as its own test here. A fresh Keras 3 process
checks that Keras 3 users do not pay for tf-keras: `import tf_lossscale`
imports no tf_keras.
"""

import json
import re

import pytest

from tests import helpers
from tests.helpers import subprocesses

JOURNEYS = [
    "wrapping_tf_keras_and_legacy_optimizers_gives_a_tf_keras_wrapper",
    "compile_under_mixed_float16_keeps_the_wrapper_without_double_scaling",
    "fit_skips_a_non_finite_step_leaving_weights_slots_and_iterations",
    "custom_loop_and_minimize_skip_non_finite_steps",
    "fit_under_mirrored_strategy_skips_a_nan_on_one_replica",
    "keras_h5_and_saved_model_files_keep_the_wrapper_and_the_scale",
    "tf_keras_code_reads_the_scale_and_asks_isinstance",
    "checkpoints_of_tf_keras_own_wrapper_restore_into_ours_and_back",
    "configs_written_by_tf_keras_wrapper_load",
    "fixed_scale_that_skips_non_finite_steps",
    "loss_scale_monitor_logs_to_history_csv_and_tensorboard",
    "xla_fit_needs_a_watcher_for_the_failure_policy",
    "loss_scale_state_from_a_file_is_checked_field_by_field",
    "gan_with_a_loss_scale_group_skips_one_optimizer_and_tracks_float32",
    "gan_with_a_loss_scale_group_under_xla",
    "gan_with_a_loss_scale_group_of_legacy_optimizers_under_mirrored",
]


_JOURNEYS_MODULE = "tests.scripts.tf_keras_journeys"


def test_the_module_holds_exactly_these_journeys(tf_keras_interpreter):
    assert tf_keras_interpreter.call(f"{_JOURNEYS_MODULE}:names") == sorted(
        JOURNEYS)


@pytest.mark.parametrize("journey", JOURNEYS)
def test_journey(tf_keras_interpreter, journey):
    tf_keras_interpreter.call(f"{_JOURNEYS_MODULE}:run", journey)


def test_docs_tf_keras_fit_example_runs_with_tf_keras(tf_keras_interpreter):
    # The README points to this guide; tests/tools/test_docs_examples.py runs
    # its every block too, checking the printed line against its comment.
    guide = helpers.ROOT / "docs" / "guides" / "tf-keras.md"
    blocks = [block for block in re.findall(r"```python\n(.*?)```",
                                             guide.read_text(), re.DOTALL)
              if block.startswith("# Run with TF_USE_LEGACY_KERAS=1")]
    assert blocks and "model.fit" in blocks[0]
    code = blocks[0] + (
        "\nimport json\nprint(json.dumps([int(optimizer.skipped_steps),"
        " int(optimizer.iterations), float(optimizer.loss_scale())]))")
    printed = tf_keras_interpreter.run(code, str(guide))
    assert json.loads(printed[-1]) == [1, 1, 512.0]


def test_import_tf_lossscale_does_not_import_tf_keras():
    code = ("import json, sys, keras, tf_lossscale\n"
            "opt = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD())\n"
            "monitor = tf_lossscale.LossScaleMonitor()\n"
            "print(json.dumps(['tf_keras' in sys.modules,"
            " type(opt).__module__, type(monitor).__module__]))")
    imported, optimizer_module, monitor_module = subprocesses.run_json(
        ["-c", code], TF_USE_LEGACY_KERAS="0")
    assert imported is False
    assert optimizer_module == "tf_lossscale.keras3.loss_scale_optimizer"
    assert monitor_module == "tf_lossscale.monitor.callback"
