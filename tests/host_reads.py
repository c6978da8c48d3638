"""Counting what a block of code reads back from tensors to the host, for
tests/test_launches.py and tests/dist_worker.py.

On a GPU each such read waits for the stream (a host synchronisation) and
breaks CUDA-graph capture. ``HostReads`` records, while active:

- every ``aten._local_scalar_dense`` that reaches the dispatcher (``.item()``,
  ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:`` go through it), with a
  TorchDispatchMode;
- the Python-level calls ``Tensor.item``, ``tolist``, ``__bool__``,
  ``__int__``, ``__float__``, ``__index__`` (``tolist`` reads the data in C++
  without dispatching), by wrapping them on ``torch.Tensor``.

``reads`` lists what was seen, ``ops`` every operator that was dispatched.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

PATCHED = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class _Mode(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.owner.ops.append(name)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.owner.reads.append(name)
        return func(*args, **(kwargs or {}))


class HostReads:
    def __enter__(self):
        self.reads, self.ops, self.saved = [], [], {}
        for name in PATCHED:
            original = getattr(torch.Tensor, name)
            self.saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited, deleted on exit

            def wrapper(t, *a, _orig=original, _name=name, **k):
                self.reads.append(f"Tensor.{_name}")
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        self.mode = _Mode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for name, fn in self.saved.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)
