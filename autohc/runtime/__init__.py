"""The runtime beside the kernels: the CPU plan (which cores compute, communicate, move
memory), the one native worker pool every kernel runs on, and memory for kernel results."""
