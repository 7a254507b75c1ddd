"""Test-only data hook for tests/test_faults.py: ``--data tests.fault_worker:data``.

Gives exactly the batches of the emitted program's synthetic data (llama-tiny / gpt-tiny
vocabulary, seed 0), and when ``AUTOPAR_TEST_KILL_AT=N`` is set, SIGKILLs rank 1 as it
asks for step index N on the first attempt (``AUTOPAR_ATTEMPT == "0"``, set by
``autopar run``'s relaunch loop), so the relaunched job does not die again.
"""
import os
import signal

from codegen.runtime.data import synthetic
from planner import zoo


def data(step, global_batch, seq_len):
    kill_at = os.environ.get("AUTOPAR_TEST_KILL_AT")
    if (kill_at is not None and int(kill_at) == step and os.environ.get("AUTOPAR_ATTEMPT") == "0"
            and os.environ.get("RANK") == "1"):
        os.kill(os.getpid(), signal.SIGKILL)
    cfg = zoo.preset(os.environ.get("AUTOPAR_TEST_MODEL", "llama-tiny"))
    return synthetic(cfg.vocab, global_batch, seq_len, 0)(step)
