"""pytest-xdist keeps each `xdist_group` on one worker (pytest.ini's
`--dist loadgroup`), so a set-up the group's tests share is built once per
run, not once per worker.

pytest-xdist 3.8 marks a group by appending "@<group>" to the node ids;
pytest 9.2 ignores that (pytest-xdist#1386) and the suite silently takes
longer: the test extra keeps pytest below 9.2, and this test names the
break if another release brings it back.
"""

import pytest

pytestmark = pytest.mark.xdist_group("tf_keras_interpreter")


def test_a_groups_tests_are_sent_to_one_worker(request):
    config = request.config
    if not hasattr(config, "workerinput"):
        assert config.getoption("numprocesses", None) in (None, 0), (
            "expected to run on an xdist worker")
        return  # One process runs everything: nothing to group.
    assert config.getvalue("loadgroup"), "pytest.ini asks for --dist loadgroup"
    assert request.node.nodeid.endswith("@tf_keras_interpreter"), (
        f"pytest-xdist did not group {request.node.nodeid!r} (pytest "
        f"{pytest.__version__}): install the test extra, "
        "pip install -e '.[test]'")
