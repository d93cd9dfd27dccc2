"""tf-keras guide claims nothing else pins, run in the session's tf-keras
process (`tests/scripts/tf_keras_wrapper_layout.py`)."""

_MODULE = "tests.scripts.tf_keras_wrapper_layout"


def test_legacy_wrapper_lists_inner_then_loss_scale_then_own_variables(
        tf_keras_interpreter):
    found = tf_keras_interpreter.call(f"{_MODULE}:legacy_wrapper_variable_order")
    assert found["class"] == "LegacyLossScaleOptimizer"
    assert found["inner_count"] > 1  # iterations and slots
    assert found["weights"] == found["variables"] == found["expected"]
    assert "skipped_steps" in found["own_names"]
    assert found["get_weights_equal"]


def test_tf_2_3_config_with_a_multiplier_of_3_loads_and_keeps_it(
        tf_keras_interpreter):
    found = tf_keras_interpreter.call(
        f"{_MODULE}:tf_2_3_config_with_multiplier_3")
    assert found["class"] == "LegacyLossScaleOptimizer"
    assert found["is_tf_keras_wrapper"]
    assert found["inner"].startswith("tf_keras")
    assert found["loaded"] == found["written"]
    assert found["scales"] == found["expected"]
    assert found["scales"][1] == 3 * found["scales"][0]  # grown by 3


def test_tf_keras_wrappers_under_bfloat16_warn_unless_the_scale_is_a_fixed_1(
        tf_keras_interpreter):
    found = tf_keras_interpreter.call(f"{_MODULE}:bfloat16_warnings")
    assert found == {"new_dynamic": [["UserWarning", True]],
                     "legacy_dynamic": [["UserWarning", True]],
                     "new_fixed_1": [], "legacy_fixed_1": []}
