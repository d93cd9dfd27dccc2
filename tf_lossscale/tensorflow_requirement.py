"""The TensorFlow releases tf_lossscale supports, checked when it is imported.

TensorFlow comes as several distributions that install the same `tensorflow`
module: `tensorflow`, `tensorflow-cpu`, `tensorflow[and-cuda]` (the same
`tensorflow` with NVIDIA's CUDA libraries), vendor builds. A package that
required one of them would have pip install it over another one the user
already has: two distributions' files in one folder. So, as TensorFlow Addons
and TensorFlow Probability do, setup.py leaves TensorFlow out of
`install_requires`, offers extras that name a distribution, and the package
checks here, at import time, that a TensorFlow is importable and in range.

setup.py runs this file on its own to read the range (`runpy.run_path`): keep
it free of imports beyond the standard library, and of TensorFlow at module
level.
"""

import os
import re

# The oldest and the newest supported release series. 2.16 is the first whose
# tf.keras is Keras 3; CI runs the suite on both ends.
OLDEST = (2, 16)
NEWEST = (2, 21)

# The same range as a pip requirement specifier, for setup.py and messages.
SPECIFIER = ">=%d.%d,<%d.%d" % (OLDEST + (NEWEST[0], NEWEST[1] + 1))

# tf_lossscale's extras that bring a TensorFlow (setup.py), each with the
# distribution it installs and what that is for.
EXTRAS = (
    ("tensorflow", "tensorflow", "CPU, and GPU where TensorFlow finds CUDA"),
    ("tensorflow-cpu", "tensorflow-cpu", "CPU only, a smaller download"),
    ("and-cuda", "tensorflow[and-cuda]",
     "GPU on Linux: tensorflow with NVIDIA's CUDA libraries"),
)


def _range_text():
    return "TensorFlow %d.%d to %d.%d (%s)" % (OLDEST + NEWEST + (SPECIFIER,))


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


def release_series(version):
    """Returns `(major, minor)` of a TensorFlow version string, or None.

    Pre-releases and nightlies count as their series: "2.17.0rc1" and
    "2.22.0-dev20250601" give (2, 17) and (2, 22).
    """
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def is_supported(version):
    """Whether TensorFlow `version` (a string) is in the supported range."""
    series = release_series(version)
    return series is not None and OLDEST <= series <= NEWEST


def unsupported_version_message(version, distribution=None):
    """The ImportError message for a TensorFlow outside the range.

    `distribution` is the pip distribution that installed the `tensorflow`
    module (e.g. "tensorflow-cpu"), when known: the fix upgrades or
    downgrades that one rather than installing another beside it.
    """
    if distribution:
        fix = ('    pip install "%s%s"   # the distribution you have' % (
            distribution, SPECIFIER))
        have = "TensorFlow %s (the %r distribution)" % (version, distribution)
    else:
        fix = ('    pip install "tensorflow%s"   # or tensorflow-cpu%s, '
               "whichever you use" % (SPECIFIER, SPECIFIER))
        have = "TensorFlow %s" % (version,)
    return (
        "tf_lossscale supports %s, but this environment has %s.\n"
        "Install a supported release of the TensorFlow you use:\n%s\n"
        "or, in a fresh environment, let an extra of tf_lossscale bring one:\n"
        "%s" % (_range_text(), have, fix, _extras_text()))


def missing_tensorflow_message():
    """The ImportError message when no `tensorflow` module is installed."""
    return (
        "tf_lossscale needs %s, and `import tensorflow` finds none.\n"
        "tf_lossscale installs no TensorFlow by itself, so that it never "
        "installs a second distribution over the one you use. Install one, "
        "e.g. with an extra:\n%s" % (_range_text(), _extras_text()))


def check_version(version, distribution=None):
    """Raises ImportError unless TensorFlow `version` is supported."""
    if not is_supported(version):
        raise ImportError(unsupported_version_message(version, distribution))


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


def check_tensorflow():
    """Imports TensorFlow; raises ImportError if it is missing or unsupported.

    Other import failures of an installed TensorFlow (a broken install, a
    missing shared library) propagate unchanged.
    """
    try:
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
    except ModuleNotFoundError as err:
        if err.name != "tensorflow":
            raise
        raise ImportError(missing_tensorflow_message()) from err
    version = getattr(tf, "__version__", "of unknown version")
    if not is_supported(version):
        module_file = getattr(tf, "__file__", None)
        distribution = module_file and installed_distribution(module_file)
        raise ImportError(unsupported_version_message(version, distribution))
