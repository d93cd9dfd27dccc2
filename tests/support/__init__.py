"""What the tests share and are not tests themselves.

Models, data and strategies the tests train with, the two oracles of the
dynamic rule (`reference_oracle`: TensorFlow's own loss scales;
`dynamic_rule_model`: an independent numpy model of the extended rule), the
hostile values, and the scripts the tests run in processes of their own
(`tf_keras_*`, `*_worker`, `multi_worker_job`), each run as
`python tests/support/<script>.py` and importing its helpers from here.
`pytest_main.py` is Bazel's runner of one test file.
"""
