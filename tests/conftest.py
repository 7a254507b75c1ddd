"""Test session setup.

Triton reads TRITON_INTERPRET when it is first imported, and any test module may import
it (the runtime, the kernels), so the CPU interpreter is switched on here, before all of
them - unless a CUDA device is present, where the kernels run for real.
"""
import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
