"""The TensorFlow, Keras and tf-keras releases tf_lossscale supports, checked
when it is imported.

One rule for the three, each with its range (`TENSORFLOW`, `KERAS`,
`TF_KERAS`): a release older than the oldest supported fails with an
ImportError that names the installed version, the range and the pip line
that fixes it; a release newer than the newest tested imports, with one
`UntestedReleaseWarning` naming the tested range (a new TensorFlow or Keras
usually works, and refusing it would break every user who upgrades before
this package does; TensorFlow Addons and TensorFlow Probability warn too).
TensorFlow and Keras are checked by `import tf_lossscale` (one warning for
both), tf-keras when the tf-keras wrapper is first imported.

How each one gets installed differs:

* TensorFlow comes as several distributions that install the same
  `tensorflow` module: `tensorflow`, `tensorflow-cpu`, `tensorflow[and-cuda]`
  (the same `tensorflow` with NVIDIA's CUDA libraries), vendor builds. A
  package that required one of them would have pip install it over another
  one the user already has: two distributions' files in one folder. So, as
  TensorFlow Addons and TensorFlow Probability do, setup.py leaves TensorFlow
  out of `install_requires` and offers extras that name a distribution.
* Keras is one pure-Python distribution, and no Keras release requires a
  TensorFlow: `install_requires` has `keras>=` the oldest supported, so pip
  upgrades an older Keras 3 it finds (TensorFlow itself accepts any Keras 3)
  and keeps a newer one.
* tf-keras is an extra (`tf-keras`), in TensorFlow's range: each tf-keras
  release requires the TensorFlow of its own series.

setup.py and the CI scripts run this file on its own to read the ranges
(`runpy.run_path`): keep it free of imports beyond the standard library, and
of TensorFlow and Keras at module level.
"""

import os
import re
import warnings


def release_series(version):
    """Returns `(major, minor)` of a version string, or None.

    Pre-releases and nightlies count as their series: "2.17.0rc1",
    "2.22.0-dev20250601" and "3.16.0.dev2025112503" give (2, 17), (2, 22)
    and (3, 16).
    """
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


class SupportedRange:
    """The release series of one package that tf_lossscale supports.

    Args:
      name: the package as users call it ("TensorFlow").
      module: the module that is imported ("tensorflow").
      oldest: the oldest supported `(major, minor)` series.
      newest: the newest tested series; CI runs the suite on both ends.
      pinned: whether installs pin the newest too (extras that bring a
        TensorFlow do, so a fresh install gets a tested release);
        otherwise only the floor is declared and pip keeps a newer release.
    """

    def __init__(self, name, module, oldest, newest, pinned):
        self.name = name
        self.module = module
        self.oldest = oldest
        self.newest = newest
        self.pinned = pinned

    @property
    def specifier(self):
        """The pip specifier installs use: ">=2.16,<2.22", or ">=3.10"."""
        floor = ">=%d.%d" % self.oldest
        if not self.pinned:
            return floor
        return floor + ",<%d.%d" % (self.newest[0], self.newest[1] + 1)

    @property
    def tested_specifier(self):
        """The tested releases as a pip specifier: ">=3.10,<3.16"."""
        return ">=%d.%d,<%d.%d" % (self.oldest + (
            self.newest[0], self.newest[1] + 1))

    def text(self):
        """"TensorFlow 2.16 to 2.21"."""
        return "%s %d.%d to %d.%d" % ((self.name,) + self.oldest + self.newest)

    def is_older(self, version):
        """Whether `version` is older than supported (or not a version)."""
        series = release_series(version)
        return series is None or series < self.oldest

    def is_newer(self, version):
        """Whether `version` is newer than the newest tested series."""
        series = release_series(version)
        return series is not None and series > self.newest


TENSORFLOW = SupportedRange("TensorFlow", "tensorflow", (2, 16), (2, 21),
                            pinned=True)
# Keras 3.10 is the oldest release whose journeys pass (measured on 3.0 to
# 3.15 with TensorFlow 2.16): before it, Keras itself fails to restore a
# checkpoint written under another dtype policy into an optimizer not built
# yet (moving a project into mixed precision), and before 3.7 and 3.5 the
# wrapper would need workarounds too. It is also the newest Keras for Python
# 3.9. The newest tested is what pip installs beside TensorFlow 2.21.
KERAS = SupportedRange("Keras", "keras", (3, 10), (3, 15), pinned=False)
TF_KERAS = SupportedRange("tf-keras", "tf_keras", TENSORFLOW.oldest,
                          TENSORFLOW.newest, pinned=True)

# tf_lossscale's extras that bring a TensorFlow (setup.py), each with the
# distribution it installs and what that is for.
EXTRAS = (
    ("tensorflow", "tensorflow", "CPU, and GPU where TensorFlow finds CUDA"),
    ("tensorflow-cpu", "tensorflow-cpu", "CPU only, a smaller download"),
    ("and-cuda", "tensorflow[and-cuda]",
     "GPU on Linux: tensorflow with NVIDIA's CUDA libraries"),
)

# The start of every UntestedReleaseWarning's message: a warnings filter on
# it works before `import tf_lossscale` (see UntestedReleaseWarning).
UNTESTED_PREFIX = "tf_lossscale is not tested with"


class UntestedReleaseWarning(UserWarning):
    """TensorFlow, Keras or tf-keras is newer than the releases tf_lossscale
    was tested with. It is given once per process and package.

    The check runs while `tf_lossscale` is imported, before this class can
    be named; to silence it, filter on the message, which always starts
    with `UNTESTED_PREFIX`:

        warnings.filterwarnings("ignore", "tf_lossscale is not tested with")

    or `PYTHONWARNINGS="ignore:tf_lossscale is not tested with"`. After the
    import (the tf-keras check comes later), the category works too.
    """


# Packages already warned about in this process.
_WARNED = set()


def _extras_text():
    width = max(len(name) for name, _, _ in EXTRAS)
    lines = [
        '    pip install "tf_lossscale[%s]"%s   # %s' % (
            name, " " * (width - len(name)), purpose)
        for name, _, purpose in EXTRAS
    ]
    lines.append('  or, in a source checkout: pip install -e ".[tensorflow]" '
                 "(or another of these extras)")
    return "\n".join(lines)


def _tensorflow_fix(distribution):
    """The pip line that installs a supported TensorFlow over `distribution`
    (the one the user has; None when unknown)."""
    spec = TENSORFLOW.specifier
    if distribution:
        return '    pip install "%s%s"   # the distribution you have' % (
            distribution, spec)
    return ('    pip install "tensorflow%s"   # or tensorflow-cpu%s, '
            "whichever you use" % (spec, spec))


def _tensorflow_have(version, distribution):
    if distribution:
        return "TensorFlow %s (the %r distribution)" % (version, distribution)
    return "TensorFlow %s" % (version,)


def unsupported_version_message(version, distribution=None):
    """The ImportError message for a TensorFlow older than supported.

    `distribution` is the pip distribution that installed the `tensorflow`
    module (e.g. "tensorflow-cpu"), when known: the fix upgrades that one
    rather than installing another beside it.
    """
    return (
        "tf_lossscale supports %s (%s), but this environment has %s.\n"
        "Install a supported release of the TensorFlow you use:\n%s\n"
        "or, in a fresh environment, let an extra of tf_lossscale bring one:\n"
        "%s" % (TENSORFLOW.text(), TENSORFLOW.specifier,
                _tensorflow_have(version, distribution),
                _tensorflow_fix(distribution), _extras_text()))


def missing_tensorflow_message():
    """The ImportError message when no `tensorflow` module is installed."""
    return (
        "tf_lossscale needs %s (%s), and `import tensorflow` finds none.\n"
        "tf_lossscale installs no TensorFlow by itself, so that it never "
        "installs a second distribution over the one you use. Install one, "
        "e.g. with an extra:\n%s" % (TENSORFLOW.text(), TENSORFLOW.specifier,
                                     _extras_text()))


def old_keras_message(version):
    """The ImportError message for a Keras older than supported."""
    return (
        "tf_lossscale supports Keras %d.%d and newer (tested: %s), but this "
        "environment has Keras %s. TensorFlow accepts any Keras 3 and pip "
        "keeps the one it finds; install a supported one (it brings no "
        "TensorFlow):\n"
        '    pip install "keras%s"' % (KERAS.oldest + (
            KERAS.text(), version, KERAS.specifier)))


def old_tf_keras_message(version):
    """The ImportError message for a tf-keras outside its supported range
    (older, or not a version)."""
    return (
        "tf_lossscale's tf-keras wrapper supports %s (%s), but this "
        "environment has tf-keras %s. Install the tf-keras of your "
        "TensorFlow's series (it requires that TensorFlow):\n"
        '    pip install "tf-keras%s"   # or: pip install '
        '"tf_lossscale[tf-keras]"' % (TF_KERAS.text(), TF_KERAS.specifier,
                                      version, TF_KERAS.specifier))


def check_version(version, distribution=None):
    """Raises ImportError if TensorFlow `version` is older than supported."""
    if TENSORFLOW.is_older(version):
        raise ImportError(unsupported_version_message(version, distribution))


def check_keras_version(version):
    """Raises ImportError if Keras `version` is older than supported."""
    if KERAS.is_older(version):
        raise ImportError(old_keras_message(version))


def check_tf_keras_version(version):
    """Raises ImportError if tf-keras `version` is older than supported."""
    if TF_KERAS.is_older(version):
        raise ImportError(old_tf_keras_message(version))


def untested_message(newer):
    """The UntestedReleaseWarning message for `newer`, a list of
    `(SupportedRange, installed version, pip line)`."""
    have = " and ".join("%s %s" % (supported.name, version)
                        for supported, version, _ in newer)
    tested = " and ".join(supported.text() for supported, _, _ in newer)
    fixes = "\n".join(fix for _, _, fix in newer)
    return (
        "%s %s: it was tested with %s. It usually works; if something "
        "fails, please report it, and meanwhile install a tested release:\n"
        "%s" % (UNTESTED_PREFIX, have, tested, fixes))


def warn_untested(newer):
    """Warns once per process about the packages in `newer` not warned
    about yet, in one warning.

    `newer` holds what the `check_*` functions returned: None, or `(range,
    installed version, pip line)` for a newer than tested release. Called at
    the top level of a module of this package, the warning points at the
    line that imported that module (`import tf_lossscale`).
    """
    newer = [entry for entry in newer
             if entry is not None and entry[0].module not in _WARNED]
    if not newer:
        return
    _WARNED.update(supported.module for supported, _, _ in newer)
    warnings.warn(untested_message(newer), UntestedReleaseWarning,
                  stacklevel=3)


def installed_distribution(module_file):
    """The pip distribution whose files include `module_file`, or None.

    `module_file` is the imported `tensorflow/__init__.py`; the distribution
    that installed it is e.g. "tensorflow" or "tensorflow-cpu".
    """
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    target = os.path.realpath(module_file)
    for dist in metadata.distributions():
        for path in dist.files or ():
            if (path.parts == ("tensorflow", "__init__.py") and
                    os.path.realpath(dist.locate_file(path)) == target):
                # Wheels spell it "tensorflow_cpu"; pip users "tensorflow-cpu".
                return re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    return None


def _import_tensorflow():
    """Imports TensorFlow; ImportError saying what to install if missing.

    Other import failures of an installed TensorFlow (a broken install, a
    missing shared library) propagate unchanged.
    """
    try:
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
    except ModuleNotFoundError as err:
        if err.name != "tensorflow":
            raise
        raise ImportError(missing_tensorflow_message()) from err
    return tf


def _distribution_of(module):
    module_file = getattr(module, "__file__", None)
    return module_file and installed_distribution(module_file)


def check_tensorflow():
    """Imports TensorFlow; raises ImportError if it is missing or older than
    supported. Returns what `warn_untested` takes if it is newer than
    tested, else None."""
    tf = _import_tensorflow()
    version = getattr(tf, "__version__", "of unknown version")
    if TENSORFLOW.is_older(version):
        raise ImportError(
            unsupported_version_message(version, _distribution_of(tf)))
    if TENSORFLOW.is_newer(version):
        return (TENSORFLOW, version,
                _tensorflow_fix(_distribution_of(tf)).strip())
    return None


def check_keras():
    """Imports Keras; raises ImportError if it is missing or older than
    supported. Returns what `warn_untested` takes if it is newer than
    tested, else None."""
    try:
        import keras  # pylint: disable=g-import-not-at-top
    except ModuleNotFoundError as err:
        if err.name != "keras":
            raise
        raise ImportError(
            "tf_lossscale needs Keras %d.%d or newer, and `import keras` "
            'finds none:\n    pip install "keras%s"' % (
                KERAS.oldest + (KERAS.specifier,))) from err
    version = getattr(keras, "__version__", "of unknown version")
    check_keras_version(version)
    if KERAS.is_newer(version):
        return (KERAS, version,
                'pip install "keras%s"' % KERAS.tested_specifier)
    return None


def check_tf_keras():
    """Imports tf-keras; raises ImportError if it is older than supported.
    Returns what `warn_untested` takes if it is newer than tested, else
    None."""
    import tf_keras  # pylint: disable=g-import-not-at-top
    version = getattr(tf_keras, "__version__", "of unknown version")
    check_tf_keras_version(version)
    if TF_KERAS.is_newer(version):
        return (TF_KERAS, version,
                'pip install "tf-keras%s"' % TF_KERAS.specifier)
    return None
