"""What the tests share and are not tests themselves.

Models, data and strategies the tests train with, the two oracles of the
dynamic rule (`reference_oracle`: TensorFlow's own loss scales;
`dynamic_rule_model`: an independent numpy model of the extended rule), the
hostile values, the code tests run in processes of their own, and those
processes' scripts (`interpreter.py`, the session's tf-keras process;
`multi_worker_job.py`, `tf1_behaviour_worker.py`, `hostile_tf_keras_worker.py`,
`tf_keras_float16_diagnosis.py`),
each run as `python tests/support/<script>.py` and importing its helpers from
here. `pytest_main.py` is Bazel's runner of one test file.
"""
