"""Which layers of a Keras model compute in float16, and what they own.

Under `mixed_float16` a layer keeps float32 variables and computes in
float16; a layer given `dtype="float32"` computes in float32. Only the
gradients of float16 layers' variables come out of a float16 backward pass
(cast to float32), so only those can underflow or overflow float16. The
layer that owns a variable is the innermost one: a nested model (anything
with a `layers` list) is looked into. Works for Keras 3 and tf-keras
models.
"""


def compute_dtype(layer):
    """The dtype `layer` computes in, e.g. "float16", as a string."""
    policy = getattr(layer, "dtype_policy", None)
    dtype = getattr(policy, "compute_dtype", None) or getattr(
        layer, "compute_dtype", None) or "float32"
    return getattr(dtype, "name", dtype)


def is_input_layer(layer):
    """Whether `layer` is a model's `InputLayer` (no computation)."""
    return type(layer).__name__ == "InputLayer"


def variable_name(variable):
    """A variable's path (Keras 3) or name (tf-keras), for reports."""
    return getattr(variable, "path", None) or variable.name


def _innermost_layers(layer):
    inner = getattr(layer, "layers", None)
    if not inner:
        yield layer
        return
    for sublayer in inner:
        yield from _innermost_layers(sublayer)


def owners(model):
    """`{id(variable): layer}` for every trainable variable of `model`: the
    innermost layer that holds it."""
    owner = {}
    for layer in _innermost_layers(model):
        for variable in layer.trainable_weights:
            owner.setdefault(id(variable), layer)
    return owner


def takes_gradient_as_value(variable):
    """Whether the optimizer writes `variable`'s gradient into it instead
    of applying it (Keras' float8 scales and amax histories): not a
    gradient to measure."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def float16_variables(model):
    """The trainable variables of `model` whose layer computes in float16,
    in `model.trainable_variables` order."""
    owner = owners(model)
    return [variable for variable in model.trainable_variables
            if id(variable) in owner
            and compute_dtype(owner[id(variable)]) == "float16"
            and not takes_gradient_as_value(variable)]
