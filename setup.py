"""Installs tf_lossscale; `pip install -e ".[test]"` adds the test tools,
`.[plot]` and `.[tensorboard]` what the demo's --plot and --logdir need."""

import pathlib
import re

import setuptools

_ROOT = pathlib.Path(__file__).parent
_VERSION = re.search(r'^__version__ = "([^"]+)"',
                     (_ROOT / "tf_lossscale" / "__init__.py").read_text(),
                     re.MULTILINE).group(1)

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
    packages=["tf_lossscale", "tf_lossscale.compat", "tf_lossscale.configs"],
    package_dir={"tf_lossscale.configs": "configs"},
    package_data={"tf_lossscale.configs": ["*.json"]},
    install_requires=[
        # 2.16 is the first release whose tf.keras is Keras 3.
        "tensorflow>=2.16,<2.22",
        "absl-py",
    ],
    extras_require={
        # `python -m tf_lossscale.demo --plot=...`.
        "plot": ["matplotlib"],
        # keras.callbacks.TensorBoard and the demo's --logdir; tensorflow
        # (-cpu) does not install it. Same release range as tensorflow.
        "tensorboard": ["tensorboard>=2.16,<2.22"],
        # tf-keras (Keras 2) optimizers, `TF_USE_LEGACY_KERAS=1`.
        "tf-keras": ["tf-keras"],
        # The suite also runs the demo's --plot and --logdir.
        "test": ["pytest", "absl-py", "matplotlib", "tensorboard>=2.16,<2.22",
                 "tf-keras"],
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
