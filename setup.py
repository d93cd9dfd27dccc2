"""Installs tf_lossscale.

TensorFlow is not in `install_requires`: it comes as several distributions
(`tensorflow`, `tensorflow-cpu`, `tensorflow[and-cuda]`, vendor builds) that
install the same `tensorflow` module, and requiring one would make pip install
it over another one the user has. As with TensorFlow Addons and TensorFlow
Probability, an extra names the distribution:

    pip install tf_lossscale                    # with the TensorFlow you have
    pip install "tf_lossscale[tensorflow]"      # or [tensorflow-cpu], [and-cuda]

and `import tf_lossscale` checks that a TensorFlow in the supported range is
installed. Keras is in `install_requires`, from the oldest supported release
on: it is one pure-Python distribution that brings no TensorFlow, and
TensorFlow itself accepts Keras releases this package does not support. The
ranges live in tf_lossscale/_internal/versions.py, which also checks them at import
time. `.[test]` adds the test tools (and `tensorflow`), `.[plot]` and
`.[tensorboard]` what the demo's --plot and --logdir need, `.[keras-hub]`
KerasHub for the suite's KerasHub model (CI installs it beside `.[test]`).
"""

import pathlib
import re
import runpy

import setuptools

_ROOT = pathlib.Path(__file__).parent
_VERSION = re.search(r'^__version__ = "([^"]+)"',
                     (_ROOT / "tf_lossscale" / "__init__.py").read_text(),
                     re.MULTILINE).group(1)
# The supported TensorFlow releases, e.g. ">=2.16,<2.22", the extras that
# bring one, and the Keras and tf-keras ranges, from the module that checks
# them at import time.
_REQUIREMENTS = runpy.run_path(
    str(_ROOT / "tf_lossscale" / "_internal" / "versions.py"))
_TF = _REQUIREMENTS["TENSORFLOW"].specifier
_TENSORFLOW_EXTRAS = {
    extra: [distribution + _TF]
    for extra, distribution, _ in _REQUIREMENTS["EXTRAS"]
}
_KERAS = "keras" + _REQUIREMENTS["KERAS"].specifier
_TF_KERAS = "tf-keras" + _REQUIREMENTS["TF_KERAS"].specifier

setuptools.setup(
    name="tf_lossscale",
    version=_VERSION,
    description=("Loss scaling (FixedLossScale, DynamicLossScale) and a Keras "
                 "LossScaleOptimizer for float16 training with TensorFlow"),
    long_description=(_ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    # The top-level configs/ folder ships inside the package as
    # tf_lossscale.configs, so the demo finds its defaults after any install.
    packages=["tf_lossscale", "tf_lossscale.configs"] + [
        "tf_lossscale." + folder.name
        for folder in sorted((_ROOT / "tf_lossscale").iterdir())
        if (folder / "__init__.py").is_file()],
    package_dir={"tf_lossscale.configs": "configs"},
    package_data={"tf_lossscale.configs": ["*.json"]},
    # No TensorFlow here, and no upper bound on Keras: see the docstring
    # above. No absl-py either: only the demo's command line uses it, and
    # every TensorFlow depends on it.
    install_requires=[_KERAS],
    extras_require={
        # "tensorflow", "tensorflow-cpu", "and-cuda": one TensorFlow each.
        **_TENSORFLOW_EXTRAS,
        # `python -m tf_lossscale.demo --plot=...`.
        "plot": ["matplotlib"],
        # keras.callbacks.TensorBoard and the demo's --logdir; tensorflow-cpu
        # does not install it. Same release range as TensorFlow.
        "tensorboard": ["tensorboard" + _TF],
        # tf-keras (Keras 2) optimizers, `TF_USE_LEGACY_KERAS=1`. tf-keras
        # depends on the `tensorflow` distribution; same release range.
        "tf-keras": [_TF_KERAS],
        # KerasHub, for the diagnosis' model zoo (its BERT): keras-hub
        # requires tensorflow-text, which depends on the `tensorflow`
        # distribution of the same minor release. Not in "test":
        # tensorflow-text has no wheels for some platforms TensorFlow has
        # (none for Linux aarch64 or Python 3.13 with 2.21), where it would
        # make the test extra fail to install; .ci/run installs it beside
        # the test extra on both legs (Keras 3.15: keras-hub 0.32; Keras
        # 3.10: 0.25.1, the last before 0.26 asked for Keras >= 3.13).
        "keras-hub": ["keras-hub>=0.25.1"],
        # The suite also runs the demo's --plot and --logdir, and the tf-keras
        # wrapper. It brings the full `tensorflow` distribution, the one
        # tf-keras depends on: run it in an environment of its own rather
        # than over a tensorflow-cpu. pytest-xdist: pytest.ini runs the suite
        # on a process per core.
        "test": _TENSORFLOW_EXTRAS["tensorflow"] + [
            # pytest 9.2 breaks pytest-xdist 3.8's groups (pytest-xdist#1386);
            # 9.0 brought faulthandler_exit_on_timeout (pytest.ini).
            "pytest>=9.0,<9.2", "pytest-xdist", "absl-py", "matplotlib", "tensorboard" + _TF,
            _TF_KERAS],
        # The documentation site: `mkdocs build --strict` (.ci/docs). Reads
        # the source with griffe; needs no TensorFlow.
        # Lower bounds: the versions the site was built with; MkDocs 2 drops
        # plugins; black lays out the API pages' signatures.
        "docs": ["mkdocs>=1.6.1,<2", "mkdocs-material>=9.8,<10",
                 "mkdocstrings>=1.0,<2", "mkdocstrings-python>=2.0,<3",
                 "black>=26.1"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
