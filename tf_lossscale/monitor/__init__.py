"""Keras callbacks that watch training: `LossScaleMonitor` and `XlaChecks`."""

from tf_lossscale.monitor.callback import BURST_GAP_STEPS
from tf_lossscale.monitor.callback import BURST_SUMMARY_SKIPS
from tf_lossscale.monitor.callback import LossScaleMonitor
from tf_lossscale.monitor.xla_callback import XlaChecks
