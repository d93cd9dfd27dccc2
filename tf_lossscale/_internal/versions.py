"""The TensorFlow, Keras and tf-keras releases tf_lossscale supports.

`check` refuses a missing or older release with an ImportError saying what
to install; `warn_untested` warns once per package about a newer one.
setup.py and .ci/run run this file: standard library imports only.
"""

import importlib
from importlib import metadata
import os
import re
import warnings


def release_series(version):
    """`(major, minor)` of a version string ("2.22.0-dev2025" too), or None."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return match and (int(match[1]), int(match[2]))


class Supported:
    """The release series `oldest` to `newest` (tested) of one package."""

    def __init__(self, name, module, oldest, newest, capped):
        self.name, self.module, self.oldest, self.newest = (
            name, module, oldest, newest)
        self.tested = "%s %d.%d to %d.%d" % (name, *oldest, *newest)
        self.tested_specifier = ">=%d.%d,<%d.%d" % (
            *oldest, newest[0], newest[1] + 1)
        # Installs cap the series only where they may bring a TensorFlow.
        self.specifier = self.tested_specifier if capped else (
            ">=%d.%d" % oldest)
        self.supported = self.tested if capped else (
            "%s %d.%d and newer (tested: %s)" % (name, *oldest, self.tested))


TENSORFLOW = Supported("TensorFlow", "tensorflow", (2, 16), (2, 21), True)
KERAS = Supported("Keras", "keras", (3, 10), (3, 15), capped=False)
TF_KERAS = Supported("tf-keras", "tf_keras", (2, 16), (2, 21), capped=True)

# setup.py's extras that bring a TensorFlow: (extra, requirement, use).
EXTRAS = (
    ("tensorflow", "tensorflow", "CPU, and GPU where TensorFlow finds CUDA"),
    ("tensorflow-cpu", "tensorflow-cpu", "CPU only, a smaller download"),
    ("and-cuda", "tensorflow[and-cuda]",
     "GPU on Linux: tensorflow with NVIDIA's CUDA libraries"),
)


class UntestedReleaseWarning(UserWarning):
    """TensorFlow, Keras or tf-keras is newer than tested (once per package
    and process). Given while `tf_lossscale` is imported, before this class
    can be named: filter it by its message, which starts the same way,
    `warnings.filterwarnings("ignore", "tf_lossscale is not tested with")`
    or `PYTHONWARNINGS="ignore:tf_lossscale is not tested with"`."""


_WARNED = set()  # The modules warned about in this process.


def _tensorflow_distribution(module):
    """The known distribution whose files were imported as `module`, or None
    (the plain one last: tf-keras installs it beside another)."""
    imported = getattr(module, "__file__", None)
    for name in ("tensorflow-cpu", "tensorflow-intel", "tensorflow-macos",
                 "tensorflow-rocm", "tensorflow") if imported else ():
        try:
            path = metadata.distribution(name).locate_file(
                "tensorflow/__init__.py")
        except metadata.PackageNotFoundError:
            continue
        if os.path.realpath(path) == os.path.realpath(imported):
            return name
    return None


def _pip_line(supported, module, specifier):
    """Installs `specifier` over the distribution that installed `module`."""
    if supported is not TENSORFLOW:
        return 'pip install "%s%s"' % (supported.module.replace("_", "-"),
                                       specifier)
    name = _tensorflow_distribution(module)
    return 'pip install "%s%s"' % (name or "tensorflow", specifier) + (
        "" if name else "   # or the TensorFlow distribution you use")


def _refusal(supported, module, problem):
    message = ("tf_lossscale supports %s, but %s. Install a supported "
               "release:\n    %s" % (supported.supported, problem, _pip_line(
                   supported, module, supported.specifier)))
    if supported is TENSORFLOW:
        message += "\nor, in a fresh environment, let an extra bring one:"
        message += "".join('\n    pip install %-30s   # %s' % (
            '"tf_lossscale[%s]"' % extra, use) for extra, _, use in EXTRAS)
    return ImportError(message)


def check(supported):
    """Imports `supported.module`; ImportError if it is missing or older than
    supported. Returns what `warn_untested` takes if it is newer than tested,
    else None."""
    try:
        module = importlib.import_module(supported.module)
    except ModuleNotFoundError as error:
        if error.name != supported.module:
            raise  # A broken install, not a missing one.
        raise _refusal(supported, None, "`import %s` finds none" %
                       supported.module) from error
    version = getattr(module, "__version__", "of unknown version")
    series = release_series(version)
    if series is None or series < supported.oldest:
        raise _refusal(supported, module, "this environment has %s %s" % (
            supported.name, version))
    if series > supported.newest:
        return supported, version, _pip_line(supported, module,
                                             supported.tested_specifier)
    return None


def warn_untested(newer):
    """One warning for the entries of `newer` (what `check` returned) not
    warned about yet. Called at a module's top level, it points at the line
    that imported that module."""
    newer = [entry for entry in newer
             if entry and entry[0].module not in _WARNED]
    if newer:
        _WARNED.update(supported.module for supported, _, _ in newer)
        warnings.warn(
            "tf_lossscale is not tested with %s: it was tested with %s. It "
            "usually works; if something fails, please report it, and "
            "meanwhile install a tested release:\n%s" % (
                " and ".join("%s %s" % (s.name, v) for s, v, _ in newer),
                " and ".join(s.tested for s, _, _ in newer),
                "\n".join(line for _, _, line in newer)),
            UntestedReleaseWarning, stacklevel=3)
