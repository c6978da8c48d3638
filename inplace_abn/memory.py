"""Activation-memory measurement (docs/DESIGN.md section 5).

`saved_bytes` counts the bytes of the distinct storages that autograd saves
for backward during a forward pass, leaving out the model's parameters (and
buffers). It is deterministic, so ratios between models are stable figures.
"""
from typing import Callable, Iterable, Optional

import torch


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


def saved_bytes(fn: Callable[[], object], exclude: Optional[Iterable[torch.Tensor]] = None) -> int:
    """Bytes of distinct storages saved for backward while ``fn()`` runs.

    Args:
        fn: runs the forward pass (its result is kept alive until counting ends).
        exclude: tensors whose storages are not counted, typically
            ``list(model.parameters()) + list(model.buffers())``.
    Returns:
        The total size in bytes of the distinct storages saved for backward.
    """
    excluded = {_storage_key(t)[0] for t in (exclude or ()) if t is not None}
    seen = {}

    def pack(t):
        if t.device.type != "meta" and t.numel() > 0:
            key, nbytes = _storage_key(t)
            if key not in excluded:
                seen[key] = max(seen.get(key, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def model_saved_bytes(model: torch.nn.Module, *inputs) -> int:
    """`saved_bytes` of ``model(*inputs)`` with its parameters and buffers left out."""
    params = list(model.parameters()) + list(model.buffers())
    return saved_bytes(lambda: model(*inputs), exclude=params)
