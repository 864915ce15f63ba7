"""gradaccel/_trace.py on its own: what it needs of the torch build it runs on."""

import subprocess
import sys

_HIDE_AND_IMPORT = """
import torch
import torch._dynamo  # torch's own modules that use the op are imported before it goes
aten = torch.ops.aten
aten.__dict__.pop("_batch_norm_with_update", None)  # an op resolved earlier is cached there
real = type(aten).__getattr__
def hide(self, name):
    if self is aten and name == "_batch_norm_with_update":
        raise AttributeError(name)
    return real(self, name)
type(aten).__getattr__ = hide
assert not hasattr(aten, "_batch_norm_with_update")
import gradaccel
from gradaccel import _trace
assert _trace._STATEFUL and "_batch_norm_with_update" not in {p.__name__ for p in _trace._STATEFUL}
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
x = torch.randn(5, 4, requires_grad=True)
for _ in range(2):
    gradaccel.checkpoint(net, x, budget=0.5).sum().backward()
print("ok")
"""


def test_a_private_aten_op_missing_from_this_torch_does_not_break_import():
    # Private ops (_batch_norm_with_update and friends) come and go between torch releases.
    done = subprocess.run([sys.executable, "-c", _HIDE_AND_IMPORT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
