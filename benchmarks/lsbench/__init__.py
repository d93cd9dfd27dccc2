"""The parts of `benchmarks/loss_scale_benchmark.py`.

Helpers (one concern each): `report` (printing, targets, Markdown tables),
`timing` (interleaved rounds), `gradient_sets` (the gradient sets of the
step-level sections), `fit_runs` (the MLP and interleaved `fit` runs),
`op_counts` (ops of a traced step), `ablations` (the step with one feature
taken away). The measurements themselves are the modules of `sections`.
"""
