"""The programs tests run in processes of their own, importing
`tests.helpers`: `interpreter.py` (the session's tf-keras process, running
`tf_keras_journeys`, `xla_ways` and `tf_keras_float16_diagnosis`),
`multi_worker_job.py` (with its `multi_worker_*_worker` scenarios),
`tf1_behaviour_worker.py` and `hostile_tf_keras_worker.py`, each run as
`python tests/scripts/<script>.py`. `pytest_main.py` is Bazel's runner of one
test file.
"""
