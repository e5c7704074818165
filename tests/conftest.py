"""Test configuration: without CUDA, Triton kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported, so it is set here, before any test module
imports moe_extension. Tests marked ``cuda`` are skipped without a CUDA device.

Random inputs are fresh in every run and reproducible: the run draws a seed (or takes ``MOE_TEST_SEED``),
prints it before the first test, and seeds torch's generators (CPU and CUDA) before each test from it and the
test's id. ``MOE_TEST_SEED=<the printed value> python -m pytest <the test>`` draws the same inputs again, on
one process or under pytest-xdist (the workers inherit the variable). Tests that seed their own generators
are unaffected. Each failure's report is printed as soon as the main process has it, not only at the end.
"""

import os
import random
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

SEED_VARIABLE = "MOE_TEST_SEED"


def pytest_configure(config):
    # In the main process; pytest-xdist's workers start later and inherit the variable, so all draw from one seed.
    os.environ.setdefault(SEED_VARIABLE, str(random.SystemRandom().randrange(1, 2**31)))


_reporter = None


def pytest_sessionstart(session):
    # Printed by the main process even with -q, before any test runs (a run cut off by a timeout still shows it).
    global _reporter
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        _reporter = reporter
        reporter.write_line(f"{SEED_VARIABLE}={os.environ[SEED_VARIABLE]} (set it to draw this run's random inputs "
                            "again)")


def pytest_runtest_logreport(report):
    # A failure's report (its last 40 lines) as soon as the main process receives it, under pytest-xdist too, besides
    # the summary at the end: a run cut off by a timeout still shows why its failed tests failed.
    if report.failed and _reporter is not None:
        lines = report.longreprtext.splitlines()[-40:]
        _reporter.write_line(f"FAILURE of {report.nodeid} ({report.when}):")
        for line in lines:
            _reporter.write_line(f"    {line}")


@pytest.fixture(autouse=True)
def _seed_random_inputs(request):
    torch.manual_seed(zlib.crc32(f"{os.environ[SEED_VARIABLE]}:{request.node.nodeid}".encode()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
