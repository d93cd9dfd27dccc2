"""`get`, `serialize`, `deserialize` and the configs shipped in `configs/`."""

import json

import keras
import pytest
import tensorflow as tf

from tests import helpers
import tf_lossscale

_CONFIGS_DIR = helpers.ROOT / "configs"
_KNOWN_CONFIGS = {"dynamic_loss_scale.json": "DynamicLossScale",
                  "fixed_loss_scale.json": "FixedLossScale"}

# Constructors for (ours, TF's reference) with the same arguments.
_LOSS_SCALES = {
    "fixed_int": lambda m: m.FixedLossScale(128),
    "fixed_fraction": lambda m: m.FixedLossScale(2.5),
    "dynamic_default": lambda m: m.DynamicLossScale(),
    "dynamic_custom": lambda m: m.DynamicLossScale(
        initial_loss_scale=4, increment_period=3, multiplier=3),
}


class _UserLossScale(tf_lossscale.LossScale):
    """A user's own loss scale: a fixed value under a config key of its own."""

    def __init__(self, value=4.0):
        super().__init__()
        self.value = float(value)

    def __call__(self):
        return tf.constant(self.value, tf.float32)

    def update(self, grads):
        del grads
        return None, True

    def get_config(self):
        return {"value": self.value}


def _loss_scale_config_files():
    """The JSON files in configs/ that hold a serialized loss scale."""
    files = {}
    for path in sorted(_CONFIGS_DIR.glob("*.json")):
        content = json.loads(path.read_text())
        if isinstance(content, dict) and "class_name" in content:
            files[path.name] = content
    return files


def _assert_same_loss_scale(ours, reference):
    assert type(ours).__name__ == type(reference).__name__
    assert ours.get_config() == reference.get_config()
    assert float(ours()) == float(reference())


@pytest.mark.parametrize("value", [1, 8, 2.5, 2**15], ids=repr)
def test_get_number_gives_fixed_loss_scale(value):
    loss_scale = tf_lossscale.get(value)
    assert isinstance(loss_scale, tf_lossscale.FixedLossScale)
    assert loss_scale.get_config() == {"loss_scale_value": float(value)}
    assert float(loss_scale()) == float(value)


def test_get_dynamic_gives_default_dynamic_loss_scale():
    loss_scale = tf_lossscale.get("dynamic")
    assert isinstance(loss_scale, tf_lossscale.DynamicLossScale)
    assert loss_scale.get_config() == (
        tf.compat.v1.mixed_precision.DynamicLossScale().get_config())


def test_get_dynamic_gives_a_fresh_loss_scale_each_time():
    first, second = tf_lossscale.get("dynamic"), tf_lossscale.get("dynamic")
    assert first is not second
    first.update([tf.constant(float("nan"))])
    assert float(first()) == float(second()) / 2


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_get_instance_returns_same_object(make):
    loss_scale = make(tf_lossscale)
    assert tf_lossscale.get(loss_scale) is loss_scale


def test_get_user_subclass_instance_returns_same_object():
    loss_scale = _UserLossScale()
    assert tf_lossscale.get(loss_scale) is loss_scale


def test_get_none_gives_none():
    assert tf_lossscale.get(None) is None


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_get_dict_deserializes(make):
    original = make(tf_lossscale)
    restored = tf_lossscale.get(tf_lossscale.serialize(original))
    assert restored is not original
    _assert_same_loss_scale(restored, original)


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_serialize_gives_class_name_and_config(make):
    loss_scale = make(tf_lossscale)
    assert tf_lossscale.serialize(loss_scale) == {
        "class_name": type(loss_scale).__name__,
        "config": loss_scale.get_config(),
    }


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_serialized_form_survives_json_round_trip(make):
    original = make(tf_lossscale)
    text = json.dumps(tf_lossscale.serialize(original))
    restored = tf_lossscale.deserialize(json.loads(text))
    _assert_same_loss_scale(restored, original)
    assert tf_lossscale.serialize(restored) == json.loads(text)


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_deserialize_reads_tf_2_1_to_2_3_keras_format(make):
    # Keras of TF 2.1-2.3 wrote a loss scale as {"class_name", "config"}
    # around the reference's own get_config().
    reference = make(tf.compat.v1.mixed_precision)
    legacy = {"class_name": type(reference).__name__,
              "config": reference.get_config()}
    restored = tf_lossscale.deserialize(json.loads(json.dumps(legacy)))
    _assert_same_loss_scale(restored, reference)


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_deserialize_reads_keras_3_serialization_of_tf_reference(make):
    reference = make(tf.compat.v1.mixed_precision)
    serialized = keras.saving.serialize_keras_object(reference)
    # Guards that the case covers the extra keys Keras 3 writes.
    assert {"module", "registered_name"} <= set(serialized)
    restored = tf_lossscale.deserialize(json.loads(json.dumps(serialized)))
    _assert_same_loss_scale(restored, reference)


@pytest.mark.parametrize("make", _LOSS_SCALES.values(), ids=_LOSS_SCALES.keys())
def test_tf_reference_reads_our_config(make):
    ours = make(tf_lossscale)
    config = json.loads(json.dumps(ours.get_config()))
    reference = getattr(tf.compat.v1.mixed_precision,
                        type(ours).__name__).from_config(config)
    _assert_same_loss_scale(ours, reference)


@pytest.mark.parametrize("class_name", ["LossScale", "NoSuchLossScale",
                                        "dynamic", "_UserLossScale"])
def test_deserialize_rejects_unknown_class_name_naming_it(class_name):
    with pytest.raises(ValueError, match=repr(class_name)):
        tf_lossscale.deserialize({"class_name": class_name, "config": {}})


def test_deserialize_builds_user_subclass_from_custom_objects():
    serialized = tf_lossscale.serialize(_UserLossScale(16))
    assert serialized == {"class_name": "_UserLossScale",
                          "config": {"value": 16.0}}
    restored = tf_lossscale.deserialize(
        json.loads(json.dumps(serialized)),
        custom_objects={"_UserLossScale": _UserLossScale})
    assert isinstance(restored, _UserLossScale)
    assert float(restored()) == 16.0


def test_custom_objects_do_not_hide_built_in_classes():
    restored = tf_lossscale.deserialize(
        tf_lossscale.serialize(tf_lossscale.FixedLossScale(4)),
        custom_objects={"_UserLossScale": _UserLossScale})
    assert isinstance(restored, tf_lossscale.FixedLossScale)


def test_deserialize_rejects_custom_object_that_is_not_a_loss_scale():
    with pytest.raises(TypeError, match="NotALossScale"):
        tf_lossscale.deserialize({"class_name": "NotALossScale", "config": {}},
                                 custom_objects={"NotALossScale": dict})


@pytest.mark.parametrize("config, error", [
    ({"class_name": "FixedLossScale"}, ValueError),
    ({"config": {"loss_scale_value": 2.0}}, ValueError),
    ({"class_name": "FixedLossScale", "confg": {"loss_scale_value": 2.0}},
     ValueError),
    ({"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0},
      "extra": 1}, ValueError),
    ({"class_name": "FixedLossScale", "config": [2.0]}, TypeError),
    ("FixedLossScale", TypeError),
    (None, TypeError),
], ids=["no_config", "no_class_name", "misspelt_config", "extra_key",
        "config_not_dict", "string", "none"])
def test_deserialize_rejects_malformed_input(config, error):
    with pytest.raises(error):
        tf_lossscale.deserialize(config)


def test_deserialize_rejects_invalid_arguments_without_creating_variables():
    config = {"class_name": "DynamicLossScale",
              "config": {"initial_loss_scale": 8, "multiplier": 1.0}}
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="multiplier"):
            tf_lossscale.deserialize(config)
        assert not tf.compat.v1.global_variables()


def test_deserialize_rejects_unknown_constructor_argument():
    # A misspelt key must not silently fall back to the default value.
    with pytest.raises((TypeError, ValueError), match="loss_scale"):
        tf_lossscale.deserialize({"class_name": "FixedLossScale",
                                  "config": {"loss_scale": 2.0}})


@pytest.mark.parametrize("value", [None, "dynamic", 2.0, {"a": 1}], ids=repr)
def test_serialize_rejects_non_loss_scale(value):
    with pytest.raises(TypeError):
        tf_lossscale.serialize(value)


def test_known_configs_are_shipped():
    assert set(_KNOWN_CONFIGS) <= set(_loss_scale_config_files())


@pytest.mark.parametrize("name", sorted(_loss_scale_config_files()))
def test_every_shipped_config_loads_as_its_class(name):
    content = _loss_scale_config_files()[name]
    loss_scale = tf_lossscale.deserialize(content)
    assert type(loss_scale) is getattr(tf_lossscale, content["class_name"])  # pylint: disable=unidiomatic-typecheck
    assert loss_scale.get_config().items() >= content["config"].items()
    if name in _KNOWN_CONFIGS:
        assert content["class_name"] == _KNOWN_CONFIGS[name]
    reference = getattr(tf.compat.v1.mixed_precision,
                        content["class_name"]).from_config(content["config"])
    _assert_same_loss_scale(loss_scale, reference)


def test_dynamic_config_holds_tf_defaults():
    content = _loss_scale_config_files()["dynamic_loss_scale.json"]
    loss_scale = tf_lossscale.deserialize(content)
    assert loss_scale.get_config() == (
        tf.compat.v1.mixed_precision.DynamicLossScale().get_config())
