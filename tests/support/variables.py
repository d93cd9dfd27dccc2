"""Reading variables for exact comparisons."""

import numpy as np


def values_of(variables):
    """Each variable's value as a numpy array of its own: a copy that a later
    assignment to the variable cannot change, compared bit for bit."""
    return [np.array(v.numpy()) for v in variables]
