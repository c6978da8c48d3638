"""Counting torch.distributed collectives, for tests/dist_worker.py and benchmarks/bench_sync.py."""
import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
               "reduce_scatter_tensor", "barrier", "reduce", "gather", "scatter", "all_to_all")


class CountCollectives:
    """Records the collectives called through torch.distributed's module attributes while
    active: ``calls`` (names), ``sizes`` ((name, numel, dtype name) of the first tensor
    argument; 0 and "" without one) and ``nbytes`` (that tensor's bytes)."""

    def __enter__(self):
        self.calls, self.sizes, self.nbytes, self.saved = [], [], [], {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapper(*a, _fn=fn, _name=name, **k):
                t = next((v for v in a if isinstance(v, torch.Tensor)), None)
                self.calls.append(_name)
                self.sizes.append((_name, 0 if t is None else t.numel(), "" if t is None else str(t.dtype)))
                self.nbytes.append(0 if t is None else t.numel() * t.element_size())
                return _fn(*a, **k)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
