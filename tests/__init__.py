"""tf_lossscale's test suite: one folder per area, helpers in `tests.helpers`,
the programs run in processes of their own in `tests.scripts`.

A package (as is each area folder) so that test files of the same name in
two areas do not collide, and so that every test imports its helpers the
same way: `from tests.helpers import training`. `docs/development.md`
lists the areas.
"""
