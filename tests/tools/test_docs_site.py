"""The documentation site documents every public name and lists every page.

`mkdocs build --strict` (.ci/docs) fails on a broken link, an unresolved
`:::` entry or a page left out of `nav`, but it cannot know that a public
name has no entry at all. Public names are `tf_lossscale.__all__` and the
`__all__` of every public subpackage (`tf_lossscale.compat.v1`, ...); each
needs a `::: tf_lossscale[.subpackage].Name` line in `docs/reference/`.
This test needs neither mkdocs nor a build.
"""

import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re

from tests import helpers
import tf_lossscale

_ROOT = helpers.ROOT
_DOCS = _ROOT / "docs"


def _public_packages():
    # The namespaces that declare public names: tf_lossscale and every
    # module or package under it that has an `__all__` (compat.v1 is a
    # module). The source is read first so that implementation modules are
    # not imported.
    yield tf_lossscale
    for info in pkgutil.walk_packages(tf_lossscale.__path__, "tf_lossscale."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        origin = importlib.util.find_spec(info.name).origin
        if re.search(r"^__all__\s*=", pathlib.Path(origin).read_text(),
                     re.MULTILINE):
            yield importlib.import_module(info.name)


def _public_names():
    return {f"{package.__name__}.{name}"
            for package in _public_packages()
            for name in getattr(package, "__all__", ())}


def _reference_entries():
    return {match for page in (_DOCS / "reference").glob("*.md")
            for match in re.findall(r"^::: (\S+)\s*$", page.read_text(),
                                    re.MULTILINE)}


def _resolve(dotted):
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


def test_every_public_name_has_an_api_reference_entry():
    names = _public_names()
    assert {"tf_lossscale.LossScaleOptimizer",
            "tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer"} <= names
    missing = names - _reference_entries()
    assert not missing, f"no ::: entry in docs/reference/ for {sorted(missing)}"


def test_api_reference_entries_are_public_names_or_modules():
    # A module entry shows a module's docstring (loss_scale.py's exact rule).
    for entry in _reference_entries():
        documented = _resolve(entry)
        assert entry in _public_names() or (
            inspect.ismodule(documented)
            and documented.__name__ == entry), entry
        assert documented.__doc__, f"{entry} has no docstring"


def test_nav_lists_every_page_and_only_pages_that_exist():
    config = (_ROOT / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:"):]
    nav = nav[:re.search(r"\n\S", nav[1:]).start() + 1]
    in_nav = set(re.findall(r"([\w./-]+\.md)\s*$", nav, re.MULTILINE))
    pages = {page.relative_to(_DOCS).as_posix() for page in _DOCS.rglob("*.md")}
    assert in_nav == pages, (sorted(pages - in_nav), sorted(in_nav - pages))


def test_demo_plot_is_where_the_demo_writes_it_and_the_site_shows_it():
    plot = "docs/loss_scale.png"
    assert (_ROOT / plot).is_file()
    assert plot in (_ROOT / "tf_lossscale" / "demo" / "__init__.py").read_text()
    assert "](../loss_scale.png)" in (_DOCS / "guides" / "monitoring.md").read_text()
