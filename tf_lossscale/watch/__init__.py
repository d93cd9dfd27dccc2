"""Watching a float16 run: `FailureWatch` notices a persistent failure,
diagnoses the model where it fails, and stops or carries the run on."""

from tf_lossscale.watch.callback import FailureWatch
from tf_lossscale.watch.failure import FailureReport
from tf_lossscale.watch.failure import Float16FailureError
from tf_lossscale.watch.failure import load_bundle
from tf_lossscale.watch.failure import save_bundle
from tf_lossscale.watch.triggers import Triggers

# FailureWatch, FailureReport and Float16FailureError are public as
# tf_lossscale's names (documented there).
__all__ = ["Triggers", "load_bundle", "save_bundle"]
