"""The outcome of tuning one problem (no torch or optuna needed to read it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels.gemm.params import GemmParams
from ..kernels.gemm.problem import GemmProblem


@dataclass
class TuneResult:
    problem: GemmProblem
    threads: int
    params: GemmParams
    gflops: float
    torch_gflops: float
    trials: int = 0
    from_registry: bool = False
    study: str = ""
    seconds: float = 0.0
    default_gflops: float | None = None     # the default's figure in the final race
    extra: dict = field(default_factory=dict)

    @property
    def speedup_vs_torch(self) -> float:
        return self.gflops / self.torch_gflops if self.torch_gflops else float("nan")

    def to_json(self) -> dict:
        p = self.problem
        return {"problem": {"op": "gemm", "name": p.name, "layout": p.layout, "M": p.M, "K": p.K,
                            "N": p.N}, "threads": self.threads, "params": self.params.to_dict(),
                "gflops": round(self.gflops, 2), "torch_gflops": round(self.torch_gflops, 2),
                "speedup_vs_torch": round(self.speedup_vs_torch, 3), "trials": self.trials,
                "from_registry": self.from_registry, "study": self.study,
                "seconds": round(self.seconds, 2),
                "default_gflops": None if self.default_gflops is None else round(self.default_gflops, 2)}

    @classmethod
    def from_entry(cls, problem: GemmProblem, threads: int, params: GemmParams,
                      entry: dict, seconds: float = 0.0) -> "TuneResult":
        return cls(problem, threads, params, entry["gflops"], entry["torch_gflops"],
                   entry.get("trials", 0), True, entry.get("study", ""), seconds,
                   entry.get("default_gflops"))
