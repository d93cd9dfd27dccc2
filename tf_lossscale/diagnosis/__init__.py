"""Why a float16 run fails: `diagnose` and its `Float16Diagnosis`."""

from tf_lossscale.diagnosis.report import Float16Diagnosis
from tf_lossscale.diagnosis.measure import diagnose
