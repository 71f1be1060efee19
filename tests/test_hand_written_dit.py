"""bench/hand_written_dit.py: a DiT written as a user would, stock vs under install()."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "hand_written_dit.py"


def test_hand_written_dit_trains_the_same_under_install_and_reports_both_times():
    out = subprocess.run([sys.executable, str(SCRIPT), "--depth", "2", "--dim", "48", "--heads", "3",
                          "--batch", "2", "--samples", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["steps"] >= 5 and r["stock_s"] > 0 and r["autohc_s"] > 0
    assert r["max_loss_rel_diff"] <= 1e-3
    assert r["ops_served_by_autohc"] >= r["steps"] * 2 * 2     # at least SDPA fwd + bwd per block
    # torch's AdamW on the installed side: every parameter of every step through autohc's pass
    assert r["ema"] and r["optimizer_params_served_by_autohc"] >= r["steps"] * 10
    assert abs(r["speedup"] - r["stock_s"] / r["autohc_s"]) < 1e-9


def test_bad_dims_are_a_one_line_error():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dim", "50", "--heads", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a multiple of --heads" in out.stderr


def test_hand_written_dit_under_autocast_trains_as_stock_autocast():
    """Under torch.autocast bf16 and install(): stock autocast's losses (bf16 rounding apart);
    where the CPU has a bf16 back-end the Linears' bf16 GEMMs are autohc's."""
    from autohc.torch.served import bf16_served
    out = subprocess.run([sys.executable, str(SCRIPT), "--depth", "2", "--dim", "96", "--heads", "3",
                          "--batch", "2", "--samples", "3", "--autocast", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["autocast_bf16"] and r["max_loss_rel_diff"] <= 2e-2
    if bf16_served():
        assert r["ops_served_by_autohc"] >= r["steps"] * 2 * 6    # per block: 6 Linears' GEMMs at least
