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

# The multi-process tests run 2-8 gloo ranks on this machine's few cores, under the scheduling
# policy autopar gives such launches (planner.entry.launch.cpu_scheduling): set for this process,
# so every launch the tests start inherits it (tests/test_precision.py 49.7 s instead of
# 54.1-55.2 s on 2 cores, twice each).
from planner.entry.launch import batch_scheduling  # noqa: E402

batch_scheduling()
