"""A record of the aten ops a call runs (tests that compare op sequences: a Python matmul against
aten's, fit's LoRA layer against peft's)."""

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """Runs every op as it is and appends ``record(func, args, kwargs, out)``'s items to ``ops``."""

    def __init__(self, record):
        super().__init__()
        self.record, self.ops = record, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += self.record(func, args, kwargs, out)
        return out
