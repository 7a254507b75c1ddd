"""Cost-model fidelity on a local CPU cluster: predictions from a profile vs a fresh measurement.

1. ``autopar profile`` measures collectives at a coarse grid of sizes and the layers of a
   model at micro-batch sizes ``--profile-batches``  -> profile.json
2. A second, independent run measures collectives at other sizes (between and on the grid
   points) and the layers at ``--check-batches`` -> measured.json
3. Every measured figure is predicted from profile.json (interpolated by the ProfileDB, as
   the planner does) and the relative error is printed and written as JSON.
4. Unless ``--no-noise``, a third run repeats step 2 exactly: how far two measurements of
   the same thing differ on this machine (the floor under any prediction error) is
   printed beside the errors.

The profiler pins every rank to its own cores, as the training runtime does
(codegen/runtime/mesh.py: pin_cpu_rank).

    python -m benchmarks.cost_fidelity [--nproc 4] [--model gpt-small] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile

from cost_models.profile_db import COLLECTIVE_KINDS, ProfileDB
from benchmarks.results import write_json


def _run_profiler(nproc: int, model: str, seq: int, batches: str, sizes: str, out: str, repeats: int) -> None:
    from cost_models.profiler import worker_args
    from planner.entry.launch import cpu_scheduling, torchrun_cmd, worker_env

    cmd = torchrun_cmd(nproc, worker_args(f"local-cpu:{nproc}", model, out, seq_len=seq, batches=batches, sizes=sizes,
                                          repeats=repeats))
    subprocess.run(cmd, check=True, env=worker_env(1), preexec_fn=cpu_scheduling(nproc, 1, "gloo"))


def _compare(prof: ProfileDB, meas: ProfileDB) -> tuple[list[dict], list[dict]]:
    """Every collective and layer sample of ``meas`` predicted from ``prof`` (relative errors); the
    FSDP2 unit samples (``profile_db.FSDP_UNIT``, not one collective) are left out."""
    comm_rows = []
    for key, samples in sorted(meas.collectives.items()):
        kind, n, link = key.split("/")
        if kind not in COLLECTIVE_KINDS:
            continue
        for s in samples:
            pred = prof.collective_time(kind, int(n), link, s.nbytes)
            comm_rows.append({"kind": kind, "group": int(n), "bytes": s.nbytes, "measured_s": s.seconds,
                              "predicted_s": pred, "err": (pred - s.seconds) / s.seconds})
    layer_rows = []
    for sig, samples in sorted(meas.layers.items()):
        for s in samples:
            pred = prof.layer_time(sig, s.batch, s.seq_len, s.tp, s.cp)
            if pred is None:
                continue
            tm, tp_ = s.fwd_s + s.bwd_s, pred[0] + pred[1]
            layer_rows.append({"layer": sig, "batch": s.batch, "tp": s.tp, "cp": s.cp, "measured_s": tm,
                               "predicted_s": tp_, "err": (tp_ - tm) / tm})
    return comm_rows, layer_rows


def _stats(rows: list[dict], tol: float) -> dict:
    """Number of rows, share within ``tol`` relative error, median and max |error|."""
    e = [abs(r["err"]) for r in rows]
    return {"n": len(e), "within": sum(x <= tol for x in e) / len(e), "median": statistics.median(e), "max": max(e)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--profile-batches", default="1,4")
    ap.add_argument("--check-batches", default="1,2,4")
    ap.add_argument("--profile-sizes", default="1024,16384,262144,4194304,67108864")
    ap.add_argument("--check-sizes", default="1024,4096,65536,1048576,16777216,67108864")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-noise", action="store_true", help="skip the repeat run that measures run-to-run noise")
    ap.add_argument("--out", default="benchmarks/results/cost_fidelity.json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="autopar-fidelity-")
    prof_path, meas_path = os.path.join(tmp, "profile.json"), os.path.join(tmp, "measured.json")
    _run_profiler(args.nproc, args.model, args.seq_len, args.profile_batches, args.profile_sizes, prof_path,
                  args.repeats)
    _run_profiler(args.nproc, args.model, args.seq_len, args.check_batches, args.check_sizes, meas_path,
                  args.repeats)
    prof, meas = ProfileDB.load(prof_path), ProfileDB.load(meas_path)
    comm_rows, layer_rows = _compare(prof, meas)
    noise = None
    if not args.no_noise:
        rep_path = os.path.join(tmp, "repeat.json")
        _run_profiler(args.nproc, args.model, args.seq_len, args.check_batches, args.check_sizes, rep_path,
                      args.repeats)
        rep_comm, rep_layers = _compare(ProfileDB.load(rep_path), meas)  # the same points: no interpolation
        noise = {"comm": _stats(rep_comm, 0.25), "layers": _stats(rep_layers, 0.15)}

    print(f"{'collective':<16}{'n':>3}{'bytes':>11}{'measured ms':>13}{'predicted ms':>14}{'error':>9}")
    for r in comm_rows:
        print(f"{r['kind']:<16}{r['group']:>3}{r['bytes']:>11}{r['measured_s'] * 1e3:>13.3f}"
              f"{r['predicted_s'] * 1e3:>14.3f}{r['err'] * 100:>8.1f}%")
    print(f"\n{'layer class':<14}{'batch':>6}{'tp':>4}{'cp':>4}{'measured ms':>13}{'predicted ms':>14}{'error':>9}")
    for r in layer_rows:
        print(f"{r['layer']:<14}{r['batch']:>6}{r['tp']:>4}{r['cp']:>4}{r['measured_s'] * 1e3:>13.2f}"
              f"{r['predicted_s'] * 1e3:>14.2f}{r['err'] * 100:>8.1f}%")
    summary = {"comm": _stats(comm_rows, 0.25), "layers": _stats(layer_rows, 0.15)}
    print(f"\n{'':<8}{'points':>7}{'within':>8}{'median |err|':>14}{'max |err|':>11}"
          f"{'repeat within':>15}{'median':>8}")
    for k, tol in (("comm", 0.25), ("layers", 0.15)):
        a, n = summary[k], (noise or {}).get(k)
        rep = f"{n['within']:>15.0%}{n['median']:>8.1%}" if n else f"{'-':>15}{'-':>8}"
        print(f"{k:<8}{a['n']:>7}{a['within']:>8.0%}{a['median']:>14.1%}{a['max']:>11.1%}{rep}   (within {tol:.0%})")
    write_json(args.out, {"args": vars(args), "summary": summary, "noise": noise, "comm": comm_rows,
                          "layers": layer_rows})


if __name__ == "__main__":
    main()
