"""Worker side of tests/test_distributed.py: one process group of WORLD gloo
ranks (CPU) runs every scenario in SCENARIOS, in order, and writes what it saw
to ``<outdir>/rank<r>.json`` after each one. Scenarios of world size w < WORLD
run on the subgroup of ranks 0..w-1 (passed explicitly as ``group``); those of
size WORLD use the default group (``group=None``). The test process only
launches the ranks (`launch`) and asserts on the reports.

Every rank of a scenario's group generates the whole (uneven) global batch from
the same seed and computes the single-process reference on it, so the
comparison needs no gathering of inputs.
"""
import faulthandler
import json
import os
import socket
import sys
import time
import traceback
import warnings
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import inplace_abn
from inplace_abn import ABN, InPlaceABN, InPlaceABNSync, convert_sync
from inplace_abn.functions import inplace_abn_sync
from inplace_abn.sync import ABNSync
from collectives import CountCollectives
from host_reads import HostReads
from reference import stock

WORLD = 4
PARAM = {"identity": 0.0, "relu": 0.0, "leaky_relu": 0.1, "elu": 0.8, "silu": 0.0}
GROUP_TIMEOUT_S = 45  # a collective waiting longer than this fails instead of hanging
FRAGILE_TIMEOUT_S = 8  # the group used by the "a rank dies" scenario

SCENARIOS = []  # (name, world size, fn(rank, group) -> dict, suite)


def scenario(name, size, suite="main"):
    """Register fn(rank, group) -> dict as a scenario of ``suite`` (one launch runs one suite)."""
    def deco(fn):
        SCENARIOS.append((name, size, fn, suite))
        return fn

    return deco


def _seed(*key):
    return zlib.crc32(repr(key).encode()) % 100000


# ---- data ---------------------------------------------------------------------------

BATCH = [3, 0, 2, 1]  # rank 1 has an empty batch at 3 and 4 ranks
TWO_RANKS = [3, 2]  # at 2 ranks both hold data: an empty rank 1 would leave nothing to synchronise
SPATIAL = {
    "2d": [(), (), (), ()],
    "4d": [(4, 3), (3, 5), (5, 2), (2, 4)],
    "4d_channels_last": [(4, 3), (3, 5), (5, 2), (2, 4)],
    "5d_channels_last_3d": [(2, 3, 2), (3, 2, 2), (2, 2, 3), (3, 3, 1)],
    "14x14": [(14, 14)] * 4,
}
FORMAT = {"2d": torch.contiguous_format, "4d": torch.contiguous_format, "4d_channels_last": torch.channels_last,
          "5d_channels_last_3d": torch.channels_last_3d, "14x14": torch.contiguous_format}


def global_batch(w, layout, C, seed, batch=None):
    """Per-rank float64 inputs and output gradients, plus the per-channel parameters."""
    g = torch.Generator().manual_seed(seed)
    batch = batch or ([3] if w == 1 else BATCH[:w])
    if layout == "2d":
        batch = [n * 2 for n in batch]
    xs, dys, rs = [], [], []
    cm = torch.randn(C, generator=g, dtype=torch.float64) * 2
    for k in range(w):
        shape = (batch[k], C) + SPATIAL[layout][k]
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + cm.view((1, C) + (1,) * (len(shape) - 2))
        xs.append(x)
        dys.append(torch.randn(shape, generator=g, dtype=torch.float64))
        rs.append(torch.randn(shape, generator=g, dtype=torch.float64))
    wt = torch.rand(C, generator=g, dtype=torch.float64) * 1.5 + 0.25
    wt = torch.where(torch.rand(C, generator=g) < 0.3, -wt, wt)
    return dict(xs=xs, dys=dys, rs=rs, w=wt, b=torch.randn(C, generator=g, dtype=torch.float64) * 0.5,
                rm=cm + torch.randn(C, generator=g, dtype=torch.float64) * 0.3,
                rv=torch.rand(C, generator=g, dtype=torch.float64) + 0.5)


def flat(ts, C):
    """Concatenate per-rank (N_k, C, ...) tensors of any spatial size into (1, C, L)."""
    return torch.cat([t.transpose(0, 1).reshape(C, -1) for t in ts], 1).unsqueeze(0)


def _sq(a, ref):
    """(|a - ref|^2, |ref|^2) in float64."""
    a, ref = a.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return [float(((a - ref) ** 2).sum()), float((ref ** 2).sum())]


def global_rel_errs(parts, group):
    """Norm-wise relative errors over all ranks from per-rank squared norms (one all_reduce)."""
    keys = sorted(parts)
    t = torch.tensor([v for k in keys for v in parts[k]], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return {k: (t[2 * i].item() ** 0.5) / max(t[2 * i + 1].item() ** 0.5, 1e-300) for i, k in enumerate(keys)}


def identical_across(tensors, group, w):
    """Whether the given tensors are bitwise equal on every rank of the group."""
    local = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    out = [torch.empty_like(local) for _ in range(w)]
    dist.all_gather(out, local, group=group)
    return all(torch.equal(out[0], o) for o in out[1:])


# ---- accuracy against one process on the concatenated batch -------------------------

def accuracy_cases():
    cases = []
    for w in (1, 2, 3, 4):
        for act in ("identity", "leaky_relu", "elu", "silu"):
            for wm in ("abs", "signed"):
                for layout in ("4d", "4d_channels_last"):
                    cases.append(dict(w=w, dtype="float64", act=act, wm=wm, layout=layout, residual=False))
    for w in (2, 4):
        for act in ("identity", "leaky_relu", "elu", "silu"):
            for layout in ("4d", "4d_channels_last"):
                wm = "signed" if (w == 4) == (layout == "4d") else "abs"
                cases.append(dict(w=w, dtype="float32", act=act, wm=wm, layout=layout, residual=False))
    for layout in ("2d", "5d_channels_last_3d"):
        cases.append(dict(w=3, dtype="float64", act="leaky_relu", wm="signed", layout=layout, residual=False))
        cases.append(dict(w=3, dtype="float32", act="silu", wm="abs", layout=layout, residual=False))
    for act in ("leaky_relu", "silu"):
        cases.append(dict(w=3, dtype="float64", act=act, wm="signed", layout="4d_channels_last", residual=True))
    for dt in ("bfloat16", "float16"):
        for act in ("leaky_relu", "silu"):
            cases.append(dict(w=2, dtype=dt, act=act, wm="abs", layout="4d", residual=False))
    cases.append(dict(w=2, dtype="float64", act="relu", wm="abs", layout="4d", residual=False))
    for i, c in enumerate(cases):
        if c["w"] == 2:
            c["batch"] = TWO_RANKS
        c["api"] = "module" if i % 2 == 0 else "functional"
        c["name"] = "acc-w{w}-{dtype}-{act}-{wm}-{layout}{r}-{api}".format(r="-residual" if c["residual"] else "", **c)
    return cases


ACCURACY = accuracy_cases()


def run_accuracy(rank, group, c):
    w, C = c["w"], c.get("C", 5)
    dtype = getattr(torch, c["dtype"])
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    p = PARAM[c["act"]]
    d = global_batch(w, c["layout"], C, _seed(c["name"]), c.get("batch"))
    momentum, eps = 0.1, 1e-5

    # reference: one process, stock float64 BatchNorm + activation on all ranks' values (rounded to dtype)
    xs = [x.to(dtype).double() for x in d["xs"]]
    rs = [r.to(dtype).double() for r in d["rs"]]
    xr = flat(xs, C).requires_grad_()
    rr = flat(rs, C).requires_grad_() if c["residual"] else None
    wr = d["w"].to(pdtype).double().clone().requires_grad_()
    br = d["b"].to(pdtype).double().clone().requires_grad_()
    rm_ref, rv_ref = d["rm"].to(pdtype).double().clone(), d["rv"].to(pdtype).double().clone()
    yr = stock(xr, wr, br, rm_ref, rv_ref, True, momentum, eps, c["act"], p, c["wm"], rr)
    inputs = [xr, wr, br] + ([rr] if c["residual"] else [])
    ref_grads = torch.autograd.grad(yr, inputs, flat([t.to(dtype).double() for t in d["dys"]], C))

    # ours: this rank's slice
    fmt = FORMAT[c["layout"]]
    x0 = d["xs"][rank].to(dtype).contiguous(memory_format=fmt).requires_grad_()
    r0 = d["rs"][rank].to(dtype).contiguous(memory_format=fmt).requires_grad_() if c["residual"] else None
    x = x0.clone(memory_format=torch.preserve_format)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # relu: "not invertible" warning
        if c["api"] == "module":
            layer = InPlaceABNSync(C, eps=eps, momentum=momentum, activation=c["act"], activation_param=p,
                                   group=group, weight_mode=c["wm"]).to(pdtype)
            with torch.no_grad():
                layer.weight.copy_(d["w"]), layer.bias.copy_(d["b"])
                layer.running_mean.copy_(d["rm"]), layer.running_var.copy_(d["rv"])
            wt, bt, rm, rv = layer.weight, layer.bias, layer.running_mean, layer.running_var
            y = layer(x, residual=r0)
        else:
            wt, bt = d["w"].to(pdtype).clone().requires_grad_(), d["b"].to(pdtype).clone().requires_grad_()
            rm, rv = d["rm"].to(pdtype).clone(), d["rv"].to(pdtype).clone()
            y = inplace_abn_sync(x, wt, bt, rm, rv, True, momentum, eps, c["act"], p, group, residual=r0,
                                 weight_mode=c["wm"])
    in_place = y.data_ptr() == x.data_ptr() and y.is_contiguous(memory_format=fmt)
    ours = torch.autograd.grad(y, [x0, wt, bt] + ([r0] if c["residual"] else []),
                               d["dys"][rank].to(dtype).contiguous(memory_format=fmt))
    # data parallel: the weight/bias gradient of the total loss is the SUM of the local ones
    wsum = torch.cat([ours[1].double(), ours[2].double()])
    dist.all_reduce(wsum, group=group)

    lo = sum(t.numel() // C for t in xs[:rank])
    n_local = x0.numel() // C
    sl = slice(lo, lo + n_local)
    parts = {
        "y": _sq(flat([y], C), yr.detach()[:, :, sl]),
        "dx": _sq(flat([ours[0]], C), ref_grads[0][:, :, sl]),
        "dw": _sq(wsum[:C], ref_grads[1]) if rank == 0 else [0.0, 0.0],
        "db": _sq(wsum[C:], ref_grads[2]) if rank == 0 else [0.0, 0.0],
        "running_mean": _sq(rm, rm_ref) if rank == 0 else [0.0, 0.0],
        "running_var": _sq(rv, rv_ref) if rank == 0 else [0.0, 0.0],
    }
    if c["residual"]:
        parts["dr"] = _sq(flat([ours[3]], C), ref_grads[3][:, :, sl])
    errs = global_rel_errs(parts, group)
    same = identical_across([rm, rv], group, w)
    return dict(errors=errs, running_stats_identical=same, in_place=in_place, local_count=n_local,
                dx_shape_ok=list(ours[0].shape) == list(x0.shape))


for _c in ACCURACY:
    scenario(_c["name"], _c["w"])(lambda rank, group, _c=_c: run_accuracy(rank, group, _c))


SILU_SEEDS = 6


@scenario("silu-float32-seeds", 2)
def _silu_float32(rank, group):
    """The worst float32 SiLU errors of the synchronised layer: 2 ranks with batches 5 and 3 of
    16 x 14 x 14, SILU_SEEDS seeds x both weight modes (module and functional), both backends."""
    worst = {}
    for backend in (["native"] if inplace_abn.HAS_NATIVE else []) + ["python"]:
        with inplace_abn.use_backend(backend):
            for seed in range(SILU_SEEDS):
                for i, wm in enumerate(("abs", "signed")):
                    c = dict(w=2, dtype="float32", act="silu", wm=wm, layout="14x14", residual=False, C=16,
                             batch=[5, 3], api=("module", "functional")[(seed + i) % 2],
                             name=f"silu-float32-{seed}-{wm}")
                    rep = run_accuracy(rank, group, c)
                    for k, e in rep["errors"].items():
                        worst[f"{backend}:{k}"] = max(worst.get(f"{backend}:{k}", 0.0), e)
    return dict(worst=worst)


# ---- several forwards in one step, ABNSync -------------------------------------------

@scenario("two-forwards-one-backward", 3)
def _two_forwards(rank, group):
    C = 4
    da, db = (global_batch(3, "4d", C, s) for s in (11, 12))
    layer = InPlaceABNSync(C, activation="elu", activation_param=0.8, group=group).double()
    ref = InPlaceABN(C, activation="elu", activation_param=0.8).double()
    with torch.no_grad():
        for m in (layer, ref):
            m.weight.copy_(da["w"]), m.bias.copy_(da["b"])
    # ours
    xa0, xb0 = da["xs"][rank].clone().requires_grad_(), db["xs"][rank].clone().requires_grad_()
    ya, yb = layer(xa0.clone()), layer(xb0.clone())
    loss = (ya * da["dys"][rank]).sum() + (yb * db["dys"][rank]).sum()
    gxa, gxb, gw = torch.autograd.grad(loss, [xa0, xb0, layer.weight])
    gw = gw.clone()
    dist.all_reduce(gw, group=group)
    # reference: stock on the concatenated batches, same order of running-stat updates
    xa, xb = flat(da["xs"], C).requires_grad_(), flat(db["xs"], C).requires_grad_()
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    wr = ref.weight
    ya_r = stock(xa, wr, ref.bias, rm, rv, True, 0.1, 1e-5, "elu", 0.8)
    yb_r = stock(xb, wr, ref.bias, rm, rv, True, 0.1, 1e-5, "elu", 0.8)
    loss_r = (ya_r * flat(da["dys"], C)).sum() + (yb_r * flat(db["dys"], C)).sum()
    gxa_r, gxb_r, gw_r = torch.autograd.grad(loss_r, [xa, xb, wr])
    offs = [sum(t.numel() // C for t in da["xs"][:k]) for k in range(4)]
    offs_b = [sum(t.numel() // C for t in db["xs"][:k]) for k in range(4)]
    parts = {
        "dxa": _sq(flat([gxa], C), gxa_r[:, :, offs[rank]:offs[rank + 1]]),
        "dxb": _sq(flat([gxb], C), gxb_r[:, :, offs_b[rank]:offs_b[rank + 1]]),
        "dw": _sq(gw, gw_r) if rank == 0 else [0.0, 0.0],
        "running_mean": _sq(layer.running_mean, rm) if rank == 0 else [0.0, 0.0],
        "running_var": _sq(layer.running_var, rv) if rank == 0 else [0.0, 0.0],
    }
    return dict(errors=global_rel_errs(parts, group),
                running_stats_identical=identical_across([layer.running_mean, layer.running_var], group, 3),
                num_batches_tracked=int(layer.num_batches_tracked))


@scenario("abnsync-exact", 3)
def _abnsync_exact(rank, group):
    """ABNSync (what convert_sync makes of ABN) equals ABN on the concatenated batch; relu allowed."""
    C = 5
    out = {}
    for act, dtype, layout in (("relu", torch.float64, "4d_channels_last"), ("leaky_relu", torch.float64, "4d"),
                               ("silu", torch.float64, "2d"), ("leaky_relu", torch.float32, "4d_channels_last"),
                               ("elu", torch.float32, "4d")):
        d = global_batch(3, layout, C, _seed("abnsync", act, str(dtype)))
        fmt = FORMAT[layout]
        p = PARAM[act]
        layer = ABNSync(C, activation=act, activation_param=p, group=group).to(dtype)
        ref = ABN(C, activation=act, activation_param=p).double()
        with torch.no_grad():
            for m in (layer, ref):
                m.weight.copy_(d["w"].to(dtype)), m.bias.copy_(d["b"].to(dtype))
                m.running_mean.copy_(d["rm"].to(dtype)), m.running_var.copy_(d["rv"].to(dtype))
        x0 = d["xs"][rank].to(dtype).contiguous(memory_format=fmt).requires_grad_()
        y = layer(x0)
        dy = d["dys"][rank].to(dtype).contiguous(memory_format=fmt)
        g = torch.autograd.grad(y, [x0, layer.weight, layer.bias], dy)
        wsum = torch.cat([g[1], g[2]]).double()
        dist.all_reduce(wsum, group=group)
        xr = flat([x.to(dtype).double() for x in d["xs"]], C).requires_grad_()
        yr = ref(xr)
        gr = torch.autograd.grad(yr, [xr, ref.weight, ref.bias], flat([t.to(dtype).double() for t in d["dys"]], C))
        lo = sum(t.numel() // C for t in d["xs"][:rank])
        sl = slice(lo, lo + x0.numel() // C)
        parts = {"y": _sq(flat([y], C), yr.detach()[:, :, sl]), "dx": _sq(flat([g[0]], C), gr[0][:, :, sl]),
                 "dw": _sq(wsum[:C], gr[1]) if rank == 0 else [0.0, 0.0],
                 "db": _sq(wsum[C:], gr[2]) if rank == 0 else [0.0, 0.0],
                 "running_mean": _sq(layer.running_mean, ref.running_mean) if rank == 0 else [0.0, 0.0],
                 "running_var": _sq(layer.running_var, ref.running_var) if rank == 0 else [0.0, 0.0]}
        out[f"{act}-{str(dtype).replace('torch.', '')}-{layout}"] = global_rel_errs(parts, group)
    return dict(errors=out)


@scenario("preserve-input", 2)
def _preserve_input(rank, group):
    """InPlaceABNSync(preserve_input=True) on a leaf that requires grad (an in-place layer
    would refuse it): x unchanged, a new output, and the results of ABN on the concatenated
    batch (float64)."""
    C, act = 5, "leaky_relu"
    d = global_batch(2, "4d", C, _seed("preserve-input"), TWO_RANKS)
    layer = InPlaceABNSync(C, activation=act, activation_param=PARAM[act], group=group, weight_mode="signed",
                           preserve_input=True).double()
    ref = ABN(C, activation=act, activation_param=PARAM[act]).double()
    with torch.no_grad():
        for m in (layer, ref):
            m.weight.copy_(d["w"]), m.bias.copy_(d["b"])
    x0 = d["xs"][rank].clone().requires_grad_()
    y = layer(x0)
    # (an empty sample has no storage to compare)
    unchanged = [bool(torch.equal(x0.detach(), d["xs"][rank])), x0.numel() == 0 or y.data_ptr() != x0.data_ptr()]
    g = torch.autograd.grad(y, [x0], d["dys"][rank].double())
    xr = flat([x.double() for x in d["xs"]], C).requires_grad_()
    with torch.no_grad():  # the signed mode's scale sign(w)(|w| + eps), as the reference's weight
        ref.weight.copy_(torch.sign(d["w"]) * (d["w"].abs() + layer.eps))
    yr = ref(xr)
    gr = torch.autograd.grad(yr, [xr], flat([t.double() for t in d["dys"]], C))
    lo = sum(t.numel() // C for t in d["xs"][:rank])
    sl = slice(lo, lo + x0.numel() // C)
    parts = {"y": _sq(flat([y], C), yr.detach()[:, :, sl]), "dx": _sq(flat([g[0]], C), gr[0][:, :, sl])}
    return dict(errors=global_rel_errs(parts, group), unchanged=unchanged)


# ---- DistributedDataParallel training --------------------------------------------------

def _net():
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        InPlaceABN(6, activation="leaky_relu", activation_param=0.1),
        nn.Conv2d(6, 6, 3, padding=1, bias=False),
        InPlaceABN(6, activation="silu", weight_mode="signed", momentum=None),
        nn.Conv2d(6, 6, 3, padding=1, bias=False),
        ABN(6, activation="elu", activation_param=1.0),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2),
    ).double()


def _ddp_data():
    g = torch.Generator().manual_seed(99)
    sizes = [[3, 2], [1, 4]]  # [micro-batch][rank]: uneven on purpose
    xs = [[torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64) * 2 + 1 for n in mb] for mb in sizes]
    ts = [[torch.randn(n, 2, generator=g, dtype=torch.float64) for n in mb] for mb in sizes]
    return xs, ts, sum(map(sum, sizes))


@scenario("ddp-training", 2)
def _ddp(rank, group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    W, steps, lr = 2, 6, 0.05
    xs, ts, n_total = _ddp_data()
    model = convert_sync(_net(), group)
    types = sorted({type(m).__name__ for m in model.modules()})
    import inspect

    # torch >= 2.14 renames broadcast_buffers to forward_sync_buffers (same meaning)
    name = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else "broadcast_buffers"
    ddp = DDP(model, process_group=group, **{name: True})
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses, ref_losses = [], []
    for _ in range(steps):
        opt.zero_grad(), ref_opt.zero_grad()
        # gradient accumulation over two micro-batches: DDP's all_reduce only after the second
        step_loss = torch.zeros((), dtype=torch.float64)
        with ddp.no_sync():
            l0 = ((ddp(xs[0][rank]) - ts[0][rank]) ** 2).sum() * W / n_total
            l0.backward()
        l1 = ((ddp(xs[1][rank]) - ts[1][rank]) ** 2).sum() * W / n_total
        l1.backward()
        step_loss += (l0 + l1).detach() / W
        dist.all_reduce(step_loss, group=group)
        losses.append(step_loss.item())
        opt.step()
        # reference: one process, the micro-batches of both ranks concatenated
        lr0 = ((ref(torch.cat(xs[0])) - torch.cat(ts[0])) ** 2).sum() / n_total
        lr0.backward()
        lr1 = ((ref(torch.cat(xs[1])) - torch.cat(ts[1])) ** 2).sum() / n_total
        lr1.backward()
        ref_losses.append((lr0 + lr1).item())
        ref_opt.step()
    state = model.state_dict()
    ref_state = ref.state_dict()
    errs = {}
    for k, v in state.items():
        r = ref_state[k]
        if v.is_floating_point():
            errs[k] = ((v - r).norm() / max(r.norm().item(), 1e-300)).item()
        else:
            errs[k] = float((v != r).sum())
    same = identical_across(list(state.values()), group, W)
    return dict(losses=losses, ref_losses=ref_losses, errors=errs, identical=same, types=types)


# ---- error paths ----------------------------------------------------------------------

def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@scenario("count-one", 2)
def _count_one(rank, group):
    """Global count 1 (rank 0: one sample of shape (1, C), rank 1: empty): same error on both."""
    layer = InPlaceABNSync(3, group=group)
    err = _catch(lambda: layer(torch.randn(1, 3) if rank == 0 else torch.randn(0, 3)))
    err_fn = _catch(lambda: inplace_abn_sync(torch.randn(1 - rank, 3, 1, 1), None, None, None, None, True,
                                             group=group))
    # the group is still in step: a valid call goes through
    after = _catch(lambda: layer(torch.randn(2 + rank, 3)))
    return dict(error=err, error_functional=err_fn, after=after)


@scenario("channel-mismatch", 2)
def _channel_mismatch(rank, group):
    C = 4 if rank == 0 else 6
    out = {}
    # a layer of another width on one rank
    out["module"] = _catch(lambda: InPlaceABNSync(C, group=group)(torch.randn(2, C, 3, 3)))
    # a layer with no tensors at all
    out["functional"] = _catch(lambda: inplace_abn_sync(torch.randn(2, C), None, None, None, None, True,
                                                        group=group))

    # models whose widths differ after an agreeing first layer ([8, 4, 8] against [8, 8, 8])
    def model():
        widths = [8, 4, 8] if rank == 0 else [8, 8, 8]
        x = torch.randn(2, 8, 3, 3)
        for c in widths:
            layer = InPlaceABNSync(c, group=group)
            x = layer(x[:, :1].expand(2, c, 3, 3).contiguous())

    out["model"] = _catch(model)
    # different precisions: the backward all_reduce would exchange buffers of different sizes
    dt = torch.float64 if rank == 0 else torch.float32
    out["dtype"] = _catch(lambda: InPlaceABNSync(3, group=group).to(dt)(torch.randn(4, 3, dtype=dt)))
    out["after"] = _catch(lambda: InPlaceABNSync(3, group=group)(torch.randn(2 + rank, 3)))
    return out


@scenario("refused-input", 2)
def _refused_input(rank, group):
    """A rank whose input is refused before the all_reduce (its channels do not match its own
    layer; an integer tensor): every rank raises at that call, none waits for it, and the
    refusing rank says why; then every rank refusing; then a valid call goes through."""
    layer = InPlaceABNSync(4, group=group)
    good = lambda: torch.randn(2 + rank, 4, 3, 3)  # noqa: E731
    out = {}
    out["channels"] = _catch(lambda: layer(torch.randn(2, 6, 3, 3) if rank == 1 else good()))
    out["dtype"] = _catch(lambda: layer(torch.ones(2, 4, 3, 3, dtype=torch.int64) if rank == 0 else good()))
    out["every-rank"] = _catch(lambda: layer(torch.randn(2, 5, 3, 3)))
    out["after"] = _catch(lambda: layer(good()))
    return out


def _protocol(rank, group):
    """Collectives per step: forward 1 (the 11-value header and 2C + 1 float64), backward 1
    (2C in the sums' dtype); the group's first call sends the header alone, then the 2C + 1."""
    from inplace_abn import _distributed

    C = 7
    # the group starts afresh here (on every rank of it, at the same point)
    _distributed.forget(dist.group.WORLD if group is None else group)
    out = {}
    for dt in (torch.float32, torch.float64):
        layer = InPlaceABNSync(C, group=group, activation="silu").to(dt)
        steps = []
        for step in range(3):
            n = 0 if rank == 1 else 2 + rank  # an empty rank takes part all the same
            x0 = torch.randn(n, C, 3, 2, dtype=dt, requires_grad=True)
            with CountCollectives() as fwd:
                y = layer(x0.clone())
            with CountCollectives() as bwd:
                y.backward(torch.randn_like(y))
            steps.append(dict(forward=fwd.sizes, backward=bwd.sizes, dx_shape=list(x0.grad.shape)))
        out[str(dt)] = steps
    return dict(steps=out, C=C)


scenario("protocol-w2", 2)(_protocol)
scenario("protocol-w4", WORLD)(_protocol)


@scenario("no-host-sync", 2)
def _no_host_sync(rank, group):
    """A synchronised training step reads nothing back to the host (docs/DESIGN.md section 4):
    InPlaceABNSync (module and functional, with an empty rank and a body that outgrows the
    capacity, i.e. the extra all_reduce) and ABNSync, forward and backward. Reports what
    HostReads saw and how many device asserts the forwards issued."""
    from inplace_abn import _distributed

    _distributed.forget(dist.group.WORLD if group is None else group)
    out = {}
    makers = {"InPlaceABNSync": lambda C: InPlaceABNSync(C, group=group, activation="leaky_relu"),
              "ABNSync": lambda C: ABNSync(C, group=group)}
    for name, make in makers.items():
        for C in (3, 9):  # the larger C after the smaller: the body does not fit, one more all_reduce
            layer = make(C)
            n = 0 if rank == 1 else 4  # an empty rank takes part all the same
            x0 = torch.randn(n, C, 3, 2, requires_grad=True)
            x = x0.clone()
            with HostReads() as fwd:
                y = layer(x)
            with HostReads() as bwd:
                y.backward(torch.randn_like(y))
            out[f"{name}-{C}"] = dict(forward=fwd.reads, backward=bwd.reads,
                                      asserts=sum("_assert_async" in o for o in fwd.ops))
    x = torch.randn(3, 4, 5)
    with HostReads() as fn:
        inplace_abn_sync(x, None, None, torch.zeros(4), torch.ones(4), True, group=group)
    out["functional"] = dict(forward=fn.reads, backward=[], asserts=sum("_assert_async" in o for o in fn.ops))
    return dict(cases=out)


# ---- ranks that disagree on C or on the precision, at any call (suite "mismatch") -----------
# Each scenario first makes the group agree on some calls, then disagrees: every rank must
# raise the same ValueError, and the group must stay usable.

def _agreeing_then_not(rank, call):
    """call(C) on both ranks with C = 3, then 5 (agreeing), then 3 on rank 0 and 5 on rank 1,
    then 40 on rank 1 (longer than any buffer the group used), then an agreeing call."""
    out = {"agree": [_catch(lambda: call(3)), _catch(lambda: call(5))]}
    out["disagree"] = _catch(lambda: call(3 if rank == 0 else 5))
    out["disagree_longer"] = _catch(lambda: call(3 if rank == 0 else 40))
    out["after"] = _catch(lambda: call(4))
    return out


@scenario("mismatch-functional-no-tensors", 2, suite="mismatch")
def _mismatch_functional(rank, group):
    def call(C):
        x = torch.randn(3 + rank, C, 2, requires_grad=True)
        y = inplace_abn_sync(x.clone(), None, None, None, None, True, group=group)
        y.sum().backward()

    return _agreeing_then_not(rank, call)


@scenario("mismatch-module-no-stats", 2, suite="mismatch")
def _mismatch_module(rank, group):
    out = {}
    for cls in (InPlaceABNSync, ABNSync):
        def call(C, cls=cls):
            layer = cls(C, affine=False, track_running_stats=False, group=group)
            x = torch.randn(2 + rank, C, 3, requires_grad=True)
            layer(x.clone()).sum().backward()

        out[cls.__name__] = _agreeing_then_not(rank, call)
    return out


@scenario("mismatch-dtype-switch", 2, suite="mismatch")
def _mismatch_dtype(rank, group):
    """A layer trained in float32 on both ranks, then rank 0 alone switches it to float64:
    before the fix the forward went through and the backward all_reduce of 2C values met
    float64 on one rank and float32 on the other (SIGABRT)."""
    out = {}
    for cls in (InPlaceABNSync, ABNSync):
        layer = cls(3, group=group)

        def step(dt):
            x = torch.randn(2 + rank, 3, 4, dtype=dt, requires_grad=True)
            layer(x.clone()).sum().backward()

        first = _catch(lambda: step(torch.float32))
        layer.to(torch.float64 if rank == 0 else torch.float32)
        switched = _catch(lambda: step(torch.float64 if rank == 0 else torch.float32))
        layer.float()
        out[cls.__name__] = dict(agree=[first], disagree=switched, after=_catch(lambda: step(torch.float32)))

    def fn(dt):
        x = torch.randn(3, 2, dtype=dt, requires_grad=True)
        inplace_abn_sync(x.clone(), None, None, None, None, True, group=group).sum().backward()

    out["functional"] = dict(agree=[_catch(lambda: fn(torch.float32)), _catch(lambda: fn(torch.float64))],
                             disagree=_catch(lambda: fn(torch.float64 if rank == 1 else torch.float32)),
                             after=_catch(lambda: fn(torch.float64)))
    return out


@scenario("mismatch-random-sequence", 2, suite="mismatch")
def _mismatch_random(rank, group):
    """80 functional calls with channel counts drawn from a shared seed (so the group's buffer
    lengths keep changing), a fifth of them with another C on rank 1: every disagreeing call
    raises on both ranks, every agreeing one equals one process on the concatenated batch."""
    g = torch.Generator().manual_seed(7)
    sizes = [1, 2, 3, 5, 8, 13, 40]
    errors, results = [], []
    for i in range(80):
        C = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
        other = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
        disagree = bool(torch.rand(1, generator=g) < 0.2) and other != C
        xs = [torch.randn(n, C, 2, generator=g, dtype=torch.float64) + 1 for n in (2, 1)]
        mine = other if (disagree and rank == 1) else C
        x = xs[rank] if mine == C else torch.randn(2, mine, 2, dtype=torch.float64)
        try:
            y = inplace_abn_sync(x.clone(), None, None, None, None, True, activation="identity", group=group)
        except ValueError as e:
            results.append(("raised", str(e).split(" (")[0]))
            continue
        ref = stock(flat(xs, C), None, None, None, None, True, 0.1, 1e-5, "identity", 0.0)
        lo = 0 if rank == 0 else xs[0].numel() // C
        err = (flat([y], C) - ref[:, :, lo:lo + x.numel() // C]).abs().max().item()
        errors.append(err)
        results.append(("ok", disagree))
    return dict(results=results, max_err=max(errors))


@scenario("eval-on-rank-0-only", WORLD)
def _eval_rank0(rank, group):
    """Rank 0 alone runs eval passes; the others do nothing until the barrier."""
    out = {}
    if rank == 0:
        t0 = time.time()
        with CountCollectives() as cc, torch.no_grad():
            for layer in (InPlaceABNSync(4, activation="silu"), ABNSync(4), ABNSync(4, track_running_stats=False)):
                layer.eval()(torch.randn(3, 4, 2, 2))
            inplace_abn_sync(torch.randn(3, 4, 2, 2), None, None, torch.zeros(4), torch.ones(4), False)
            model = convert_sync(nn.Sequential(InPlaceABN(4), nn.Conv2d(4, 4, 1), ABN(4))).eval()
            model(torch.randn(2, 4, 3, 3))
        out = dict(collectives=cc.calls, seconds=time.time() - t0)
    dist.barrier()
    return out


@scenario("eval-track-running-stats-false", 2)
def _eval_no_stats(rank, group):
    """InPlaceABNSync(track_running_stats=False).eval(): batch statistics, but no collective?"""
    layer = InPlaceABNSync(4, track_running_stats=False, group=group).eval()
    with CountCollectives() as cc, torch.no_grad():
        layer(torch.randn(3, 4, 2, 2))
    return dict(collectives=cc.calls)


@scenario("not-a-member", WORLD)
def _not_member(rank, group):
    g1 = GROUPS[1]
    if rank == 0:
        return dict(error=None)
    return dict(error=_catch(lambda: InPlaceABNSync(3, group=g1)(torch.randn(4, 3))))


@scenario("rank-dies-mid-step", WORLD)
def _rank_dies(rank, group):
    """The last rank exits between forward and backward; the others must error out, not hang."""
    g = FRAGILE
    layer = InPlaceABNSync(4, group=g)
    x0 = torch.randn(3, 4, 2, 2, requires_grad=True)
    y = layer(x0.clone())
    if rank == WORLD - 1:
        os._exit(0)
    t0 = time.time()
    err = _catch(lambda: y.sum().backward())
    return dict(error=err, seconds=time.time() - t0, timeout=FRAGILE_TIMEOUT_S)


# ---- the rank's main ------------------------------------------------------------------

GROUPS = {}
FRAGILE = None


def main(rank, world, port, outdir, backend, deadline_s, suite="main"):
    global FRAGILE
    faulthandler.dump_traceback_later(deadline_s, exit=True)  # a hang prints its stack and ends
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*native extension not available.*")
    report = {}
    path = os.path.join(outdir, f"rank{rank}.json")

    def save():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    for w in range(1, world):
        GROUPS[w] = dist.new_group(list(range(w)))
    GROUPS[world] = None
    FRAGILE = dist.new_group(list(range(world)), timeout=timedelta(seconds=FRAGILE_TIMEOUT_S))
    report["_start"] = dict(backend=backend)
    save()
    with inplace_abn.use_backend(backend):
        for name, size, fn, in_suite in SCENARIOS:
            if rank >= size or in_suite != suite:
                continue
            t0 = time.time()
            try:
                res = dict(ok=True, **fn(rank, GROUPS[size]))
            except Exception as e:  # noqa: BLE001
                res = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            res["wall_s"] = time.time() - t0
            report[name] = res
            save()
    report["_done"] = True
    save()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # the dead rank broke the group: skip teardown


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(outdir, world=WORLD, backend=None, deadline_s=150, suite="main"):
    """Run every scenario of ``suite`` on ``world`` processes; returns {scenario: {rank: report}}.

    Processes come from torch.multiprocessing (forkserver where available: torch
    is imported once, not once per rank). A rank still running at the deadline
    is killed; its missing scenarios are then absent from the result.
    """
    import torch.multiprocessing as mp

    if backend is None:
        backend = "native" if inplace_abn.HAS_NATIVE else "python"
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    port = _free_port()
    procs = [ctx.Process(target=main, args=(r, world, port, outdir, backend, deadline_s - 5, suite), daemon=True)
             for r in range(world)]
    t0 = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, deadline_s - (time.time() - t0)))
    killed = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in killed:
        procs[r].kill()
        procs[r].join(5)
    reports = {}
    for r in range(world):
        try:
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                reports[r] = json.load(f)
        except (OSError, ValueError):
            reports[r] = {}
    out = {}
    for name, size, _, in_suite in SCENARIOS:
        if in_suite != suite:
            continue
        out[name] = {r: reports[r][name] for r in range(size) if name in reports[r]}
    out["_meta"] = dict(killed=killed, exitcodes=[p.exitcode for p in procs], seconds=time.time() - t0,
                        done=[bool(reports[r].get("_done")) for r in range(world)], method=method)
    return out
