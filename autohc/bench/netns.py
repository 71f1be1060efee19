"""Two "hosts" on one machine: network namespaces joined by a veth pair, the link optionally
shaped with tc (a token bucket at 1/10/25 Gbit/s), for `autohc bench scale --netns`.

Needs root (CAP_NET_ADMIN) and iproute2. The namespaces and the link are removed afterwards,
also when the measurement fails. Traffic never leaves this machine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

HOSTS = ("autohc-h0", "autohc-h1")
DEVS = ("autohc-v0", "autohc-v1")
ADDRS = ("10.77.0.1", "10.77.0.2")
PORT = 29577


class NetnsError(RuntimeError):
    """The namespaces could not be set up (not root, no iproute2, a kernel without netns)."""


def parse_rate(text: str) -> int:
    """'1gbit' / '10Gbit' / '500mbit' -> bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", (text or "").lower())
    if not m:
        raise ValueError(f"link rate {text!r}: use e.g. 1gbit, 10gbit, 500mbit")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip() or 'failed'}")


def _teardown() -> None:
    for h in HOSTS:
        subprocess.run(["ip", "netns", "del", h], capture_output=True)


def setup(rate_bits: int | None) -> None:
    if shutil.which("ip") is None or (rate_bits and shutil.which("tc") is None):
        raise NetnsError("iproute2 (ip, tc) is not installed")
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root")
    _teardown()                                     # what an interrupted run left
    for h in HOSTS:
        _ip("netns", "add", h)
    _ip("link", "add", DEVS[0], "type", "veth", "peer", "name", DEVS[1])
    for h, d, a in zip(HOSTS, DEVS, ADDRS):
        _ip("link", "set", d, "netns", h)
        _ip("-n", h, "addr", "add", f"{a}/24", "dev", d)
        _ip("-n", h, "link", "set", d, "up")
        _ip("-n", h, "link", "set", "lo", "up")
        if rate_bits:
            burst = max(rate_bits // 8 // 100, 64 * 1024)          # 10 ms of traffic
            r = subprocess.run(["tc", "-n", h, "qdisc", "add", "dev", d, "root", "tbf", "rate",
                                f"{rate_bits}bit", "burst", str(burst), "latency", "200ms"],
                               capture_output=True, text=True)
            if r.returncode:
                raise NetnsError(f"tc on {d}: {r.stderr.strip()}")


RANK_CODE = """
import json, sys, torch
torch.set_num_threads(1)
from autohc.runtime import dist
from autohc.bench.scale import allreduce_sweep
rank, sizes, repeats = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
dist.init(dist.Launch(rank, 2, 0, "netns", sys.argv[4], int(sys.argv[5])))
out = allreduce_sweep(sizes, repeats)
if rank == 0:
    print(json.dumps({str(k): v for k, v in out.items()}))
dist.shutdown()
"""


def run_on_hosts(argv: list[str], rate_bits: int | None, *, env: dict | None = None,
                 timeout: int = 1800) -> list[subprocess.CompletedProcess]:
    """`python -m autohc.cli ARGV` as rank 0 in one namespace and rank 1 in the other (the
    torchrun variables set, rank 0's address as MASTER_ADDR): a two-host job on one machine."""
    setup(rate_bits)
    try:
        procs = []
        for rank, (h, d) in enumerate(zip(HOSTS, DEVS)):
            e = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": d, "RANK": str(rank),
                 "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(PORT)}
            procs.append(subprocess.Popen(["ip", "netns", "exec", h, sys.executable, "-m", "autohc.cli", *argv],
                                          env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]
    finally:
        _teardown()


def allreduce_between_hosts(sizes, repeats: int, rate_bits: int | None, timeout: int = 600) -> dict[int, float]:
    """The all-reduce sweep with one rank in each namespace: {bytes: median seconds}."""
    setup(rate_bits)
    try:
        procs = []
        for rank, (h, d) in enumerate(zip(HOSTS, DEVS)):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": d}
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", h, sys.executable, "-c", RANK_CODE, str(rank),
                 json.dumps(list(sizes)), str(repeats), ADDRS[0], str(PORT)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=timeout) for p in procs]
        for p, (_, err) in zip(procs, outs):
            if p.returncode:
                raise NetnsError(f"a rank in a namespace failed: {err.strip().splitlines()[-1] if err.strip() else p.returncode}")
        return {int(k): v for k, v in json.loads(outs[0][0].strip().splitlines()[-1]).items()}
    finally:
        _teardown()
