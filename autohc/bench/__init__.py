"""Measurement: timing (the one protocol), gemm (`autohc bench gemm`), ops (`bench ops`),
step (`bench step`), gate (the CI perf-regression gate), peak (FMA peak, bandwidth)."""
