"""tests/conftest.py's seeding: a run prints MOE_TEST_SEED before its first test, the same seed draws the same
random inputs again, and another seed (or none) draws new ones; and a failure's report is printed when it happens.
Runs pytest in a subprocess on a copy of the conftest beside a test that prints a random draw."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''
import torch

def test_draw():
    print("DRAW", float(torch.rand(1)))
'''


def _probe(folder: Path, source: str) -> Path:
    """``folder`` with a copy of the conftest beside a test module of ``source``."""
    shutil.copy(Path(__file__).with_name("conftest.py"), folder / "conftest.py")
    (folder / "test_probe.py").write_text(source)
    return folder


def _pytest(folder: Path, *options: str, seed: str | None = None) -> subprocess.CompletedProcess:
    """pytest on ``folder`` in a subprocess, MOE_TEST_SEED set to ``seed`` (unset for None)."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_TEST_SEED"}
    if seed is not None:
        env["MOE_TEST_SEED"] = seed
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *options, "-p", "no:cacheprovider", str(folder)],
                          capture_output=True, text=True, env=env, cwd=folder, timeout=300)


def _run(folder: Path, seed: str | None) -> tuple[str, str]:
    out = _pytest(folder, "-s", seed=seed).stdout
    printed = re.search(r"^MOE_TEST_SEED=(\d+) ", out, re.M)
    draw = re.search(r"DRAW (\S+)", out)
    assert printed and draw, out
    return printed.group(1), draw.group(1)


def test_seed_printed_and_reproducible(tmp_path):
    _probe(tmp_path, PROBE)
    seed, first = _run(tmp_path, "5")
    assert (seed, first) == ("5", _run(tmp_path, "5")[1])
    assert _run(tmp_path, "6")[1] != first
    drawn_seed, drawn = _run(tmp_path, None)
    assert _run(tmp_path, drawn_seed)[1] == drawn


FAILING = '''
def test_fails():
    assert 1 == 2, "the reason " + "of the failure"
'''


def test_failure_reported_when_it_happens(tmp_path):
    """A failure's message reaches the output even with the end-of-run tracebacks off (--tb=no): the conftest
    prints each failure's report when the main process receives it."""
    run = _pytest(_probe(tmp_path, FAILING), "--tb=no")
    assert run.returncode == 1 and "FAILURE of test_probe.py::test_fails (call):" in run.stdout, run.stdout
    assert "the reason of the failure" in run.stdout, run.stdout
