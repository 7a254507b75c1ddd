"""tests/launches.py: a launch that loses a process to a fatal signal runs once more (with a
warning); any other failure, or a second crash, is returned as it is."""
from __future__ import annotations

import sys

import pytest

from launches import LaunchCrashed, crashed, run_launch

# segfaults (a real SIGSEGV, via faulthandler's test hook) while the marker file is missing, creating it
CRASH_ONCE = ("import faulthandler, os, sys; m = sys.argv[1]\n"
              "if not os.path.exists(m): open(m, 'w').close(); faulthandler._sigsegv()\n"
              "print('ran')")


def test_a_crash_runs_again_once_with_a_warning(tmp_path):
    marker = tmp_path / "m"
    with pytest.warns(LaunchCrashed, match="killed by a signal"):
        proc = run_launch([sys.executable, "-c", CRASH_ONCE, str(marker)])
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"


def test_a_second_crash_is_returned(tmp_path):
    always = "import faulthandler; faulthandler._sigsegv()"
    with pytest.warns(LaunchCrashed):
        proc = run_launch([sys.executable, "-c", always])
    assert crashed(proc) and proc.returncode == -11
    assert "Fatal Python error" in proc.stderr  # PYTHONFAULTHANDLER: the Python stack is printed


def test_an_ordinary_failure_is_not_retried(tmp_path, recwarn):
    marker = tmp_path / "m"
    fail_once = "import os, sys; m = sys.argv[1]\nif not os.path.exists(m): open(m, 'w').close(); sys.exit(3)"
    proc = run_launch([sys.executable, "-c", fail_once, str(marker)])
    assert proc.returncode == 3 and not crashed(proc)
    assert not [w for w in recwarn if issubclass(w.category, LaunchCrashed)]


def test_torchrun_summary_of_a_crashed_rank_counts():
    from subprocess import CompletedProcess

    summary = "Root Cause (first observed failure):\n  exitcode  : -11 (pid: 6105)  (SIGSEGV)\n" \
              "  traceback : Signal 11 (SIGSEGV) received by PID 6105"
    assert crashed(CompletedProcess([], 1, "", summary))
    assert not crashed(CompletedProcess([], 1, "", "traceback : Signal 15 (SIGTERM) received by PID 1"))
