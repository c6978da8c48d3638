"""Cross-process reductions of InPlaceABNSync (docs/DESIGN.md section 4).

An all_reduce whose length or dtype differs between ranks cannot be caught
afterwards: gloo aborts the process with the smaller buffer (SIGABRT,
"Received data size doesn't match") and resets the others' connections; NCCL
hangs or reads past the buffer. So no collective here ever has a length or a
dtype that a rank chooses alone.

Forward: one all_reduce(SUM), in float64, of a fixed header followed by a body
of ``capacity`` values:

    header  [1, c0, c0^2, c1, c1^2, c2, c2^2, c3, c3^2, p, p^2]
                                                C = c0 + 2^8 c1 + 2^16 c2 + 2^24 c3 (C < 2^32),
                                                p = 1 (float32 sums: float16, bfloat16 or
                                                float32 inputs, which may mix) or 2 (float64)
    body    [n_k, n_k (m_k - K), M2_k + n_k (m_k - K)^2, 0 ...]   2C + 1 values, zero-padded

``capacity`` is a function of the group's agreed history only (below), so
every rank hands in the same length. After the reduction every rank holds the
same sums: the first entry is the number of ranks W, and ranks agree on a
digit d exactly when W * sum(d^2) == (sum d)^2 (Cauchy-Schwarz). The sums are
integers below W 2^16 < 2^53, hence exact in float64, and the products below
W^2 2^16 < 2^63 for W < 2^21 ranks, hence exact in int64: the verdict is
computed on the device, never read on the host (no synchronisation), and
checked with ``torch._assert_async``. Every rank evaluates the same verdict
from the same numbers, so on disagreement every rank fails the same check at
the same call: on the CPU (gloo) the check is synchronous and raises the same
ValueError on every rank, before any other collective; on CUDA it is a
device-side assert, which stops each rank's stream before the collectives
queued after it run. When they agree, 2C + 1 is agreed: if it exceeded
``capacity`` (the body did not fit), every rank runs one more all_reduce of
exactly 2C + 1 values with its body.

Capacity. Each agreed call appends its 2C + 1 to the group's history. The
capacity of the next call is the largest 2C + 1 that ever followed the same
last 8 agreed values, or, for a context not seen yet, the largest 2C + 1 of
the group so far (0 at the group's first call). Being computed from reduced
values only, it is the same on every rank, by induction over the group's
calls. A network that repeats its layers sends nearly the exact lengths from
its third step on (measured: 1.9% more than needed for ResNet-50, 0.2% for
MobileNetV2; the second step pads the 8 calls whose context spans the step
boundary). The extra collective runs only when a call needs more than its
context predicts; the stored values only grow, so for a repeating network
that happens in the first step only (6 extra collectives for ResNet-50's 53
layers, 9 for MobileNetV2's 52).

Backward: one all_reduce(SUM) of [S_g, S_gx], 2C values in the dtype of the
sums. The sums are computed from the tensors the forward saved, so their
length 2C and their dtype (float64 for float64 inputs, else float32) are
exactly the C and precision that the forward verified on every rank.

A rank that refuses its input before its statistics exist still joins the
forward all_reduce (`refuse_together`: the header says 2^32 - 1 channels),
so the others fail the channel check at that call instead of pairing their
all_reduce with the refusing rank's next call.

What this cannot catch: ranks that run the synchronised layers in different
orders or numbers (divergent control flow) meet mismatched forward and
backward collectives; that breaks DistributedDataParallel and
torch.nn.SyncBatchNorm alike.
"""
import functools
import weakref

import torch
import torch.distributed as dist

HEADER = 11
CONTEXT = 8  # agreed lengths that key the capacity prediction
MAX_CONTEXTS = 4096  # the table is cleared when it grows past this (on every rank alike)


class _GroupState:
    """What all ranks of a group agree on: the lengths of its verified calls."""

    def __init__(self):
        self.recent = ()  # the last CONTEXT agreed 2C + 1
        self.following = {}  # context -> largest 2C + 1 that followed it
        self.largest = 0

    def capacity(self) -> int:
        return self.following.get(self.recent, self.largest)

    def record(self, need: int) -> None:
        if len(self.following) >= MAX_CONTEXTS:
            self.following.clear()
        self.following[self.recent] = max(self.following.get(self.recent, 0), need)
        self.largest = max(self.largest, need)
        self.recent = (self.recent + (need,))[-CONTEXT:]


_states = {}  # id(process group) -> (weak reference to it, _GroupState)


def _state(group) -> _GroupState:
    key = id(group)
    entry = _states.get(key)
    if entry is None or entry[0]() is not group:
        entry = _states[key] = (weakref.ref(group, lambda _, key=key: _states.pop(key, None)), _GroupState())
    return entry[1]


def forget(group) -> None:
    """Start the group's agreed history afresh (on every rank of it at the same point)."""
    _states.pop(id(group), None)


def _precision(dtype: torch.dtype) -> int:
    """Code of the backward sums' dtype: 2 for float64, 1 for float32."""
    return 2 if dtype == torch.float64 else 1


def _header(C: int, precision: int):
    if not 0 <= C < 2 ** 32:
        raise ValueError(f"InPlaceABNSync: at most 2^32 - 1 channels, got {C}")
    digits = [(C >> (8 * i)) & 0xFF for i in range(4)] + [precision]
    return [1.0] + [float(v) for d in digits for v in (d, d * d)]


@functools.lru_cache(maxsize=256)
def _header_tensor(C: int, precision: int, device: torch.device) -> torch.Tensor:
    """The header as a float64 tensor (cached: only read, by torch.cat)."""
    return torch.tensor(_header(C, precision), dtype=torch.float64, device=device)


def _verdicts(head: torch.Tensor):
    """(channels agree, precision agrees) as 0-dim bool tensors on head's device.

    head: the reduced (HEADER,) float64 header. All W values of a digit agree iff
    W * sum(d^2) == (sum d)^2, in int64: exact (see the module docstring)."""
    h = head.to(torch.int64)
    agree = h[0] * h[2::2] == h[1::2] * h[1::2]
    return agree[:4].all(), agree[4]


def assert_on_device(ok: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where the 0-dim bool ``ok`` is False, without reading it
    on the host (``torch._assert_async``): on the CPU the check runs at once and
    raises ValueError(message); on CUDA a failure is a device-side assert that
    surfaces as a RuntimeError at the next synchronisation."""
    try:
        torch._assert_async(ok, message)
    except RuntimeError as e:
        if message not in str(e):
            raise
        raise ValueError(message) from None


def _check(C: int, precision: int, head: torch.Tensor) -> None:
    """Fail on every rank alike when the reduced header shows disagreement (channels first)."""
    channels_ok, precision_ok = _verdicts(head)
    assert_on_device(channels_ok, (
        f"InPlaceABNSync: ranks disagree on the channel count (this rank has {C}), or a rank refused its "
        "input (its own error says why); every rank must feed the layer valid inputs with the same channels"))
    mine = "float64" if precision == 2 else "float32"
    assert_on_device(precision_ok, (
        "InPlaceABNSync: ranks disagree on the input precision (some run float64, others a lower "
        f"precision; this rank reduces in {mine}); every rank must use the same dtype"))


def reduce_stats(mean, var, count: int, group, shift=None):
    """Combine per-rank (count, mean, biased var) into the global ones: one all_reduce,
    no host read (docs/DESIGN.md section 4).

    Args:
        mean, var: (C,) local statistics in the accumulation dtype (zeros when count == 0);
            that dtype is the one of the backward sums, verified here.
        count: local number of elements per channel.
        group: the process group.
        shift: (C,) shift K common to all ranks (the running mean), or None for 0.
            Non-finite entries are replaced by 0 (same on every rank).
    Returns:
        (mean, var, count): global (C,) mean and biased var in mean's dtype (zeros when the
        global count is 0), and the global count as a 0-dim float64 tensor on mean's device
        (an exact integer).
    Raises:
        ValueError, on every rank of the group together, when the ranks disagree on C or
        on the precision (on CUDA: a device-side assert on every rank, see `assert_on_device`).
    """
    C = mean.numel()
    precision = _precision(mean.dtype)
    state = _state(group)
    m = mean.double()
    if shift is None:
        k = torch.zeros_like(m)
    else:
        k = shift.detach().double()
        k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
    d = m - k
    n = float(count)
    body = torch.cat([m.new_full((1,), n), n * d, var.double() * n + n * d * d])
    need, cap = 2 * C + 1, state.capacity()
    head = _header_tensor(C, precision, m.device)
    fits = need <= cap
    packed = torch.cat([head, body if fits else body[:0], m.new_zeros(cap - need if fits else cap)])
    dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)
    _check(C, precision, packed[:HEADER])
    state.record(need)  # host-side: need and cap are agreed once the check holds
    if fits:
        sums = packed[HEADER : HEADER + need]
    else:  # agreed by every rank: C is verified and cap is common
        dist.all_reduce(body, dist.ReduceOp.SUM, group=group)
        sums = body
    n_all = sums[0]
    has = n_all > 0
    n_safe = torch.where(has, n_all, 1.0)  # every rank empty: the sums are 0, so are s1, s2
    s1, s2 = sums[1 : C + 1] / n_safe, sums[C + 1 :] / n_safe
    g_mean = torch.where(has, k + s1, 0.0)
    g_var = (s2 - s1 * s1).clamp_(min=0)
    return g_mean.to(mean.dtype), g_var.to(var.dtype), n_all


# The header's channel count from a rank that refused its input (no layer has 2^32 - 1 channels).
REFUSED = 2**32 - 1


def refuse_together(group, *tensors) -> None:
    """Take part in this call's forward all_reduce for a rank that refused its input before
    computing anything: the header says REFUSED channels and the body is zeros, so every
    other rank fails `reduce_stats`'s channel check at this same call instead of waiting for
    this rank; the caller then raises its own error. Where every rank refused, they all get
    here and raise theirs. No rank records the call, so the group's length history stays
    common. tensors: the call's arguments, the first tensor among them giving the device."""
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    packed = torch.cat([_header_tensor(REFUSED, 1, device),
                        torch.zeros(_state(group).capacity(), dtype=torch.float64, device=device)])
    dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)


def reduce_grad_sums(sum_gz, sum_gzx, group, count=None):
    """Sum the per-channel S_g and S_gx over the group (one all_reduce, in their dtype);
    divided by ``count`` (the forward's global count, a device tensor) when given.

    Their length 2C and dtype are those the forward's `reduce_stats` verified on every rank
    (the sums come from the tensors the forward saved)."""
    C = sum_gz.numel()
    packed = torch.cat([sum_gz, sum_gzx])
    dist.all_reduce(packed, dist.ReduceOp.SUM, group=group)
    if count is not None:
        packed = packed / count
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
