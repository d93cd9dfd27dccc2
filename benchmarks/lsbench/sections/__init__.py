"""The benchmark's sections, one measurement each.

A section is a module with `NAME` (for `--only=NAME`), `TITLE` and
`run(context)` (`lsbench.context.Context`); see the runner's docstring.
"""
