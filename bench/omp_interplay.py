"""Does autohc's thread pool fight torch's OpenMP pool? Measure it.

autohc's kernels run on the process's one worker pool (pthreads, not OpenMP), whose workers
spin for at most 200 us after a job and then sleep on a condition variable. torch's libgomp
threads also spin after a parallel region. This script times, at T threads each:
  alone:        autohc GEMM back-to-back
  after torch:  autohc GEMM right after a torch op that used all OpenMP threads
  torch alone / torch after autohc: the same for torch's GEMM
and prints the slowdowns (median of repeats, interleaved).

    python bench/omp_interplay.py [--threads 2] [--size 1024]
"""
import argparse
import json
import statistics
import time

import torch

import autohc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=1024, help="M = K = N of the GEMMs")
    ap.add_argument("--repeats", type=int, default=41)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    x = torch.randn(4 * n, n)
    out, tout = torch.empty(n, n), torch.empty(n, n)

    def ah():
        autohc.matmul(a, b, out=out, threads=args.threads)

    def th():
        torch.mm(a, b, out=tout)

    def torch_elementwise():  # an OpenMP region of torch's, like a GELU between two GEMMs
        torch.nn.functional.gelu(x, approximate="tanh")

    for f in (ah, th, torch_elementwise):
        f(); f()
    s = {k: [] for k in ("autohc_alone", "autohc_after_torch", "torch_alone", "torch_after_autohc")}

    def timed(f):
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    for _ in range(args.repeats):
        ah(); s["autohc_alone"].append(timed(ah))
        torch_elementwise(); s["autohc_after_torch"].append(timed(ah))
        th(); s["torch_alone"].append(timed(th))
        ah(); s["torch_after_autohc"].append(timed(th))
    med = {k: statistics.median(v) * 1e3 for k, v in s.items()}
    res = {"threads": args.threads, "size": n, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
           "autohc_slowdown_after_torch": round(med["autohc_after_torch"] / med["autohc_alone"], 3),
           "torch_slowdown_after_autohc": round(med["torch_after_autohc"] / med["torch_alone"], 3)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
