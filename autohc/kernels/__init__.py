"""Generated kernels: one subpackage per family (gemm, eltwise), each with typed parameters,
codegen from templates/ and its written contract (docs/kernel-contract.md); `family` is the interface
they share, `isa` the vector back-ends, `render` the Jinja environment, `runtime` the native
worker pool every kernel runs its threads on."""
