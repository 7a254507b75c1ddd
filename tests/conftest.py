"""Test session setup.

Triton reads TRITON_INTERPRET when it is first imported, and any test module may import
it (the runtime, the kernels), so the CPU interpreter is switched on here, before all of
them - unless a CUDA device is present, where the kernels run for real.
"""
import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Plans for local-cpu clusters use this machine's cached calibration and profile the machine
# when there is none (planner/entry/calibration.py). Tests plan uncalibrated and never touch
# the user's cache, unless a test asks for it (tests/test_machine_calibration.py).
os.environ["AUTOPAR_CALIBRATE"] = "0"
os.environ.setdefault("AUTOPAR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "autopar"))

# The multi-process tests run 2-8 gloo ranks on this machine's few cores. Under the default
# policy a rank woken by a peer's message preempts whatever runs, and gloo's event loops keep
# waking: a 1 KB all_reduce over 4 ranks on 2 cores took 5.7 ms; under SCHED_BATCH (no wakeup
# preemption; throughput unchanged) 1.2 ms, and tests/test_precision.py ran in 49.7 s instead of
# 54.1-55.2 s (twice each). Set for this process, so every launch the tests start inherits it.
if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # not permitted here: the default policy, only slower
        pass
