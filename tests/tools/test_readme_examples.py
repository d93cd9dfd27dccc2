"""The README's self-contained Python examples run as written.

A block counts as self-contained when its first line is an import; the
others (distribution, custom loops) are fragments that rely on a model and
data of the reader's own.
"""

import re

import pytest

from tests import helpers

_README = helpers.ROOT / "README.md"
_BLOCKS = re.findall(r"```python\n(.*?)```", _README.read_text(), re.DOTALL)
_RUNNABLE = [block for block in _BLOCKS if block.startswith("import ")]

pytestmark = pytest.mark.usefixtures("keras_isolation")


def test_readme_has_runnable_examples_of_the_api_and_keras():
    assert any("DynamicLossScale(" in block for block in _RUNNABLE)
    assert any("LossScaleOptimizer(" in block and "model.fit" in block
               for block in _RUNNABLE)


@pytest.mark.parametrize("block", _RUNNABLE,
                         ids=[f"example_{i}" for i in range(len(_RUNNABLE))])
def test_readme_example_runs(block):
    exec(compile(block, str(_README), "exec"), {})  # pylint: disable=exec-used
