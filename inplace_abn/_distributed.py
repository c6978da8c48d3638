"""Cross-process reductions of InPlaceABNSync (DESIGN.md section 4).

Forward: one float64 all_reduce(SUM) of [n_k, n_k (m_k - K), M2_k + n_k (m_k - K)^2]
(2C + 1 values). Backward: one all_reduce(SUM) of [S_g, S_gx] (2C values).
"""
import torch
import torch.distributed as dist

# (group, C) pairs whose channel counts were verified to agree on every rank.
_checked_channels = set()


def _check_channels(C: int, group, device) -> None:
    """Once per (group, C): make sure every rank has the same channel count.

    A mismatch would make the stats all_reduce exchange buffers of different
    lengths (a hang or garbage), so it is caught first with one tiny MAX
    reduction of [C, -C].
    """
    key = (id(group), C)
    if key in _checked_channels:
        return
    t = torch.tensor([C, -C], dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
    cmax, cmin = int(t[0].item()), int(-t[1].item())
    if cmax != cmin:
        raise ValueError(
            f"InPlaceABNSync: ranks disagree on the channel count (this rank has {C}, the group has "
            f"between {cmin} and {cmax}); every rank must feed the layer inputs with the same channels"
        )
    _checked_channels.add(key)


def reduce_stats(mean, var, count: int, group, shift=None):
    """Combine per-rank (count, mean, biased var) into the global ones.

    Args:
        mean, var: (C,) local statistics (zeros when count == 0).
        count: local number of elements per channel.
        shift: (C,) common shift K (the running mean), or None for 0.
    Returns:
        (mean, var, count): global (C,) mean and biased var in mean's dtype, global count (int).
    """
    C = mean.numel()
    _check_channels(C, group, mean.device)
    m = mean.double()
    k = shift.double() if shift is not None else torch.zeros_like(m)
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
    """Sum the per-channel S_g and S_gx over the group (one all_reduce)."""
    C = sum_gz.numel()
    packed = torch.cat([sum_gz, sum_gzx])
    dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)
    return packed[:C], packed[C:]
