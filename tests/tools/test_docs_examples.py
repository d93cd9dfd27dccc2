"""The documentation site's self-contained Python examples run as written.

As in the README (`test_readme_examples.py`), a ```python block counts as
self-contained when its first line is an import; the others are fragments
that rely on a model, data or a cluster of the reader's own. A block whose
first line is `# Run with TF_USE_LEGACY_KERAS=1 ...` (the tf-keras guide)
is runnable too: it needs `tf.keras` to be tf-keras, which this process,
having imported Keras 3, cannot give it, so it runs in the session's
tf-keras process (`TF_USE_LEGACY_KERAS=1` set before TensorFlow's import).

What the examples print is what their comments say: a runnable block's
`print(...)` calls each take one line and each prints one line, and a
trailing comment (`print(x)  # 512.0: one back-off`) starts with the line
printed, followed by the end of the comment or a space, colon or bracket.
"""

import contextlib
import io
import re

import pytest

from tests import helpers

_DOCS = helpers.ROOT / "docs"
_PAGES = sorted(_DOCS.rglob("*.md"))


def _blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


_LEGACY_KERAS = "# Run with TF_USE_LEGACY_KERAS=1"
_RUNNABLE = [(page, block) for page in _PAGES for block in _blocks(page)
             if block.startswith(("import ", _LEGACY_KERAS))]

# Guide pages whose code cannot run in this suite, and why. Everything else
# in docs/guides/ with Python code must have a runnable example.
_NO_RUNNABLE_EXAMPLE = {}

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _name(page):
    return page.relative_to(_DOCS).as_posix()


def test_every_guide_with_python_code_has_a_runnable_example():
    with_code = {_name(page) for page in _PAGES
                 if page.parent.name == "guides" and _blocks(page)}
    with_runnable = {_name(page) for page, _ in _RUNNABLE}
    missing = {name for name in with_code - with_runnable
               if name.rsplit("/", 1)[-1] not in _NO_RUNNABLE_EXAMPLE}
    assert not missing, f"guides with only fragments: {sorted(missing)}"
    # The exemptions name pages that exist and still need them.
    for name in _NO_RUNNABLE_EXAMPLE:
        assert f"guides/{name}" in with_code - with_runnable, name


def test_examples_cover_the_loss_scales_and_keras():
    assert any("DynamicLossScale(" in block for _, block in _RUNNABLE)
    assert any("LossScaleOptimizer(" in block and "model.fit" in block
               for _, block in _RUNNABLE)


@pytest.mark.parametrize("page, block", [
    pytest.param(page, block, id=f"{_name(page)}-{index}", marks=[
        pytest.mark.xdist_group("tf_keras_interpreter")]
                 if block.startswith(_LEGACY_KERAS) else [])
    for index, (page, block) in enumerate(_RUNNABLE)])
def test_docs_example_runs_and_prints_what_it_says(page, block, request):
    prints = [line for line in block.splitlines()
              if re.match(r"\s*print\(", line)]
    for line in prints:
        code = line.split("  # ", 1)[0]
        assert code.count("(") == code.count(")"), f"{line!r} spans lines"
    if block.startswith(_LEGACY_KERAS):
        printed = request.getfixturevalue("tf_keras_interpreter").run(
            block, str(page))
    else:
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(block, str(page), "exec"), {})  # pylint: disable=exec-used
        printed = output.getvalue().splitlines()
    assert len(printed) == len(prints), printed
    for line, actual in zip(prints, printed):
        if "  # " not in line:
            continue
        claimed = line.split("  # ", 1)[1].strip()
        assert re.fullmatch(re.escape(actual) + r"([ :(].*)?", claimed), (
            f"{line.strip()!r} printed {actual!r}")


def test_tf_keras_examples_run_with_tf_keras_as_tf_keras():
    # The tf-keras guide shows what tf-keras users run, and it runs here.
    blocks = [block for page, block in _RUNNABLE
              if _name(page) == "guides/tf-keras.md"]
    assert blocks and all(block.startswith(_LEGACY_KERAS) for block in blocks)
