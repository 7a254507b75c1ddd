"""A local two-region rig with a really slow link: ranks in two Linux network namespaces
joined by one veth pair whose two ends are rate-limited by ``tc qdisc tbf``.

Layout (``Rig``): namespaces ``<tag>r0`` and ``<tag>r1``, the pair ``<tag>v0`` / ``<tag>v1``
with addresses ``10.<a>.<b>.1`` and ``.2`` (/24), loopback up in each. Every region runs one
torchrun with ``--nnodes 2`` and its node rank, the rendezvous on region 0's address, and
gloo bound to the region's veth (``GLOO_SOCKET_IFNAME``): ranks of one region reach each other
through their own namespace (no limit), ranks of different regions only through the pair, so
exactly the traffic that crosses the cut pays the rate. Global ranks ``[0, n)`` sit in region
0 and ``[n, 2n)`` in region 1, so a plan's outermost mesh dimension (``pp``, else ``dp``) of
size 2 is the one that crosses.

What it models: bandwidth only. This kernel has ``tbf`` and ``htb`` but not ``netem``, so a
WAN's latency stays a simulated term of the cost model; the veth's own latency is the
kernel's (tens of microseconds).

Limits of ``tbf`` (tc-tbf(8)): a burst of ``BURST_BYTES`` leaves at line rate, so the bucket is
kept small (32 KiB; tbf splits the veth's larger GSO segments to fit it): with 256 KiB a
pipeline's activations of a small model crossed without ever meeting the limit.

Needs Linux, root (CAP_NET_ADMIN) and ``ip`` / ``tc`` (iproute2): :func:`rig_problem` says in
one line what is missing. Everything the rig creates is removed on exit (deleting a namespace
deletes its veth end and qdisc), also after a failure part way.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from planner.errors import AutoparError

BURST_BYTES = 32 * 1024      # tbf bucket (module docstring)
QUEUE_LATENCY_MS = 200       # tbf: the longest a packet may wait in the queue before it is dropped


@dataclass(frozen=True)
class RigSpec:
    """Two regions of ``nproc`` ranks each joined by a link of ``rate_mbit`` Mbit/s per
    direction (None: no limit, the veth's own speed)."""
    nproc: int = 2
    rate_mbit: float | None = 200.0

    def __post_init__(self):
        if self.nproc < 1:
            raise AutoparError(f"a rig region needs at least one rank, not {self.nproc}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise AutoparError(f"rig link rate {self.rate_mbit} Mbit/s: give a positive rate, or none for no limit")


def rig_problem() -> str | None:
    """Why a rig cannot be made here (one line), or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"approbe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    try:
        tbf = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                              "rate", "1mbit", "burst", str(BURST_BYTES), "latency", "50ms"],
                             capture_output=True, text=True)
        if tbf.returncode != 0:
            return f"`tc qdisc add ... tbf` failed: {tbf.stderr.strip() or tbf.returncode}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise AutoparError(f"rig setup: `{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")


class Rig:
    """The two namespaces and their link, made on ``__enter__`` and removed on ``__exit__``."""

    def __init__(self, spec: RigSpec, tag: str | None = None):
        self.spec = spec
        pid = os.getpid()
        self.tag = tag or f"ap{pid % 100000}"
        self.subnet = f"10.{64 + pid % 64}.{pid // 64 % 250}"

    def ns(self, region: int) -> str:
        return f"{self.tag}r{region}"

    def ifname(self, region: int) -> str:
        return f"{self.tag}v{region}"

    def addr(self, region: int) -> str:
        return f"{self.subnet}.{region + 1}"

    def __enter__(self) -> "Rig":
        problem = rig_problem()
        if problem:
            raise AutoparError(f"cannot build the two-region rig: {problem}")
        self._remove()
        try:
            for k in (0, 1):
                _sh("ip", "netns", "add", self.ns(k))
            _sh("ip", "link", "add", self.ifname(0), "type", "veth", "peer", "name", self.ifname(1))
            for k in (0, 1):
                _sh("ip", "link", "set", self.ifname(k), "netns", self.ns(k))
                _sh("ip", "-n", self.ns(k), "addr", "add", f"{self.addr(k)}/24", "dev", self.ifname(k))
                _sh("ip", "-n", self.ns(k), "link", "set", self.ifname(k), "up")
                _sh("ip", "-n", self.ns(k), "link", "set", "lo", "up")
                if self.spec.rate_mbit is not None:
                    _sh("ip", "netns", "exec", self.ns(k), "tc", "qdisc", "add", "dev", self.ifname(k), "root", "tbf",
                        "rate", f"{self.spec.rate_mbit:g}mbit", "burst", str(BURST_BYTES),
                        "latency", f"{QUEUE_LATENCY_MS}ms")
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        for k in (0, 1):
            subprocess.run(["ip", "netns", "del", self.ns(k)], capture_output=True)

    def region_cmd(self, region: int, module_args: list[str], port: int) -> list[str]:
        """torchrun for ``region``'s ranks inside its namespace (node rank = region)."""
        return ["ip", "netns", "exec", self.ns(region), sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node-rank", str(region), "--nproc-per-node", str(self.spec.nproc),
                "--master-addr", self.addr(0), "--master-port", str(port), *module_args]

    def region_env(self, region: int, env: dict) -> dict:
        """``env`` with gloo bound to ``region``'s end of the link, and the region's ranks pinned
        to their own slice of this machine's cores (``codegen.runtime.mesh.pin_cpu_rank``)."""
        return dict(env, GLOO_SOCKET_IFNAME=self.ifname(region), AUTOPAR_HOST_RANKS=str(2 * self.spec.nproc),
                    AUTOPAR_HOST_RANK_BASE=str(region * self.spec.nproc))


@dataclass(frozen=True)
class RigRun:
    """How a launch on the rig ended: 0 when both regions' torchruns exited 0, else the first
    failing exit code (124: killed at the timeout); each region's stdout and stderr when captured."""
    rc: int
    stdout: tuple[str, ...] = ()
    stderr: tuple[str, ...] = ()


def launch_across(rig: Rig, module_args: list[str], env: dict, timeout_s: float | None = None, *,
                  port: int | None = None, capture: bool = False) -> RigRun:
    """Run ``module_args`` (a script and its arguments, as torchrun takes them) on both regions
    of ``rig`` at once, the rendezvous on ``port`` of region 0 (default: one derived from this
    process id); ``capture`` keeps each region's output instead of passing it through."""
    import signal
    import time

    port = port if port is not None else 29400 + os.getpid() % 500
    pipe = subprocess.PIPE if capture else None
    procs = [subprocess.Popen(rig.region_cmd(k, module_args, port), env=rig.region_env(k, env), stdout=pipe,
                              stderr=pipe, text=True, start_new_session=True) for k in (0, 1)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        outs = [p.communicate(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                for p in procs]
    except subprocess.TimeoutExpired:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
            q.wait()
        return RigRun(124)
    rc = next((p.returncode for p in procs if p.returncode != 0), 0)
    return RigRun(rc, tuple(o or "" for o, _ in outs), tuple(e or "" for _, e in outs))
