"""The ops a call dispatches, as a TorchDispatchMode sees them (for tests that check an op stays
visible to modes)."""
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchLog(TorchDispatchMode):
    """with DispatchLog() as log: ...; log.names holds each dispatched op's name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
