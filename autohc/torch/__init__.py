"""autohc inside PyTorch: dispatch (install/uninstall: aten ops routed to the kernels, ATen
for everything else and for kernels that cannot run), served (what it takes, ATen's captured
kernels, the call counts), autocast (a Linear on its fp32 weight
under torch.autocast bf16, no bf16 copy), ops (the fused operators as custom ops
with autograd), optim (AdamW on the fused step), threads (autohc's thread count), fallback
(one warning per cause when a kernel cannot run)."""
