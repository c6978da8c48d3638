"""Cross-process reductions of InPlaceABNSync (DESIGN.md section 4).

Forward: one float64 all_reduce(SUM) of [n_k, n_k (m_k - K), M2_k + n_k (m_k - K)^2]
(2C + 1 values). Backward: one all_reduce(SUM) of [S_g, S_gx] (2C values in the
dtype of the sums: float64 for float64 inputs, else float32).

Channel check. An all_reduce whose length differs between ranks is not an
error the library can catch afterwards: gloo aborts the process with the
smaller buffer (SIGABRT), NCCL hangs or returns garbage. So before the first
statistics collective of each layer, every rank runs one tiny fixed-length
check, a MAX all_reduce of [C, -C, b, -b] (b: 64 or 32, the bit width of the
backward sums), and all ranks raise the same ValueError when they disagree.
"First" is decided per layer instance, not per channel count: the layer is
identified by its first tensor among weight, bias, running_mean and
running_var (held weakly), so on ranks that build the same model every rank
runs its checks at the same calls, and a rank whose model has other widths
meets the others in a check, never in a statistics collective. Layers with
no tensors at all (affine=False and track_running_stats=False) fall back to
one check per (group, C). After that no step pays for a check: the one
collective per forward of DESIGN.md holds.

What this cannot catch: ranks that, after every layer's first use, call the
synchronised layers in different orders or numbers (divergent control flow).
That breaks DistributedDataParallel and torch.nn.SyncBatchNorm alike.
"""
import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

# layer tensor -> process groups this layer was checked on (identity compared).
_checked_layers = WeakIdKeyDictionary()
# (id(group), C) -> group, for layers with no tensor to key on.
_checked_shapes = {}


def _bits(dtype: torch.dtype) -> int:
    return 64 if dtype == torch.float64 else 32


def _layer_key(layer):
    for t in layer or ():
        if t is not None:
            return t
    return None


def _already_checked(key, group, C) -> bool:
    if key is None:
        return _checked_shapes.get((id(group), C)) is group
    return any(g is group for g in _checked_layers.get(key, ()))


def _mark_checked(key, group, C) -> None:
    if key is None:
        _checked_shapes[(id(group), C)] = group
    else:
        _checked_layers.setdefault(key, []).append(group)


def check_channels(C: int, grad_dtype: torch.dtype, group, device, layer=None) -> None:
    """On a layer's first synchronised call: same channel count and sum dtype on every rank.

    Args:
        C: this rank's channel count.
        grad_dtype: dtype of the backward sums (the backward all_reduce's dtype).
        group: the process group.
        device: where the collective runs (the input's device).
        layer: the layer's (weight, bias, running_mean, running_var); its first
            tensor that is not None identifies the layer.
    Raises:
        ValueError on every rank of the group together when the ranks disagree.
    """
    key = _layer_key(layer)
    if _already_checked(key, group, C):
        return
    b = _bits(grad_dtype)
    t = torch.tensor([C, -C, b, -b], dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
    cmax, cmin, bmax, bmin = (int(v) for v in (t[0].item(), -t[1].item(), t[2].item(), -t[3].item()))
    if cmax != cmin:
        raise ValueError(
            f"InPlaceABNSync: ranks disagree on the channel count (this rank has {C}, the group has "
            f"between {cmin} and {cmax}); every rank must feed the layer inputs with the same channels"
        )
    if bmax != bmin:
        raise ValueError(
            "InPlaceABNSync: ranks disagree on the input precision (some run float64, others a lower "
            f"precision; this rank reduces in float{b}); every rank must use the same dtype"
        )
    _mark_checked(key, group, C)


def reduce_stats(mean, var, count: int, group, shift=None, layer=None):
    """Combine per-rank (count, mean, biased var) into the global ones: one all_reduce.

    Args:
        mean, var: (C,) local statistics in the accumulation dtype (zeros when count == 0).
        count: local number of elements per channel.
        group: the process group.
        shift: (C,) shift K common to all ranks (the running mean), or None for 0.
            Non-finite entries are replaced by 0 (same on every rank).
        layer: see `check_channels` (only the layer's first call runs the check).
    Returns:
        (mean, var, count): global (C,) mean and biased var in mean's dtype, global count (int).
    """
    C = mean.numel()
    check_channels(C, mean.dtype, group, mean.device, layer)
    m = mean.double()
    if shift is None:
        k = torch.zeros_like(m)
    else:
        k = shift.detach().double()
        k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
    d = m - k
    n = float(count)
    packed = torch.cat([m.new_full((1,), n), n * d, var.double() * n + n * d * d])
    dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)
    n_all = packed[0].item()  # exact: counts are integers below 2^53
    if n_all == 0:
        return mean.new_zeros(C), var.new_zeros(C), 0
    s1, s2 = packed[1 : C + 1] / n_all, packed[C + 1 :] / n_all
    g_mean = k + s1
    g_var = (s2 - s1 * s1).clamp_(min=0)
    return g_mean.to(mean.dtype), g_var.to(var.dtype), int(round(n_all))


def reduce_grad_sums(sum_gz, sum_gzx, group):
    """Sum the per-channel S_g and S_gx over the group (one all_reduce, in their dtype)."""
    C = sum_gz.numel()
    packed = torch.cat([sum_gz, sum_gzx])
    dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)
    return packed[:C], packed[C:]


def resolve_group(group):
    """The group to synchronise over (None: the world), refusing a group this rank is not in."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"InPlaceABNSync: rank {dist.get_rank()} is not a member of the layer's process group; "
            "only the group's ranks may run the layer"
        )
    return group
