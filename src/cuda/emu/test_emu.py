"""Runs the CUDA kernels of inplace_abn on the CPU, through the emulator in
src/cuda/emu (emu_runtime.h), against a float64 reference of DESIGN.md's math.

Needs no GPU: it compiles src/cuda/ops_impl.h + src/cuda/kernels.cuh with the
host compiler as the operators of a separate library, inplace_abn_emu, on CPU
tensors. It checks the index arithmetic (layouts, vector and scalar paths,
tails, grid-stride loops, chunked reductions and their combination), the warp
intrinsics (mask packing, shuffles; a divergent or partial warp is an error)
and the block barriers. It cannot check speed, races or real-GPU behaviour.

    python src/cuda/emu/test_emu.py [--quick]
"""
import itertools
import math
import os
import random
import sys
import tempfile

import torch
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))

Z_STAR = -1.2784645427610738
Y_STAR = -0.2784645427610738


def build():
    build_dir = os.path.join(tempfile.gettempdir(), "iabn_emu_build")
    os.makedirs(build_dir, exist_ok=True)
    load(
        name="iabn_emu",
        sources=[os.path.join(HERE, "emu_ops.cpp")],
        extra_include_paths=[SRC, HERE],
        extra_cflags=["-O1", "-fno-strict-aliasing", "-Wno-unknown-pragmas"],
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.inplace_abn_emu


# ---------------------------------------------------------------------------
# float64 reference

def bshape(x):
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def gain(weight, C, eps, signed):
    if weight is None:
        return torch.ones(C, dtype=torch.float64)
    w = weight.double()
    a = w.abs() + eps
    return torch.where((w < 0) & signed, -a, a) if signed else a


def act_fwd(z, act, p):
    if act == 0:
        return z
    if act == 1:
        return torch.where(z >= 0, z, z * p)
    if act == 2:
        return torch.where(z >= 0, z, p * torch.expm1(torch.clamp(z, max=0)))
    return z * torch.sigmoid(z)


def silu_inv(y, left):
    # bisection in float64 on the branch given by `left`
    y = torch.clamp(y, min=Y_STAR)
    lo = torch.where(left, torch.full_like(y, -745.0), torch.full_like(y, Z_STAR))
    hi = torch.where(left, torch.full_like(y, Z_STAR), torch.clamp(y, min=0) + 1.0)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        fm = mid * torch.sigmoid(mid)
        # left branch: f decreasing; right: increasing
        go_right = torch.where(left, fm > y, fm < y)
        lo = torch.where(go_right, mid, lo)
        hi = torch.where(go_right, hi, mid)
    return 0.5 * (lo + hi)


def act_inv(y, left, act, p, tiny=1e-16):
    if act == 0:
        return y
    if act == 1:
        return torch.where(y >= 0, y, y / p)
    if act == 2:
        return torch.where(y >= 0, y, torch.log1p(torch.clamp(y / p, min=-1 + tiny)))
    return silu_inv(y, left)


def act_deriv(z, act, p):
    if act == 0:
        return torch.ones_like(z)
    if act == 1:
        return torch.where(z >= 0, torch.ones_like(z), torch.full_like(z, p))
    if act == 2:
        return torch.where(z >= 0, torch.ones_like(z), p * torch.exp(torch.clamp(z, max=0)))
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def mem_order(t):
    """Elements of a dense tensor in memory order (1D)."""
    return torch.as_strided(t.detach(), (t.numel(),), (1,), t.storage_offset()).clone() if t.numel() else t.reshape(-1)


def pack_bits(bits):
    n = bits.numel()
    words = (n + 31) // 32
    b = torch.zeros(words * 32, dtype=torch.int64)
    b[:n] = bits.to(torch.int64)
    w = (b.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(1)
    w = torch.where(w >= 2**31, w - 2**32, w)
    return w.to(torch.int32)


def unpack_bits(mask, n):
    w = mask.to(torch.int64) & 0xFFFFFFFF
    bits = (w.view(-1, 1) >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.view(-1)[:n].bool()


def like_layout(t, ref):
    """t (contiguous) laid out as ref (same strides)."""
    out = torch.empty_strided(ref.shape, ref.stride(), dtype=t.dtype)
    out.copy_(t)
    return out


# ---------------------------------------------------------------------------

def make_x(shape, dtype, layout, offset, gen):
    """A tensor of `shape` in `layout` whose data pointer is `offset` elements
    past an aligned allocation (misaligned for offset % vec != 0)."""
    n = math.prod(shape)
    buf = torch.randn(n + offset, generator=gen, dtype=torch.float64).to(dtype)
    flat = buf[offset:]
    if layout == "contiguous":
        return flat.view(shape)
    # channels-last: memory order (N, S..., C)
    perm_shape = [shape[0]] + list(shape[2:]) + [shape[1]]
    t = flat.view(perm_shape)
    order = [0, t.dim() - 1] + list(range(1, t.dim() - 1))
    return t.permute(order)


def tol_of(dtype):
    return {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]


def close(a, b, tol, what):
    a = a.double()
    b = b.double()
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() + 1.0 if b.numel() else 1.0
    if not err <= tol * scale:
        raise AssertionError(f"{what}: max err {err:.3e} > {tol:.1e} * {scale:.3e}")


def check_case(ops, shape, dtype, layout, act, offset, resid, affine, signed, gen, stats=True):
    p = {0: 0.0, 1: 0.01, 2: 1.0, 3: 0.0}[act]
    eps = 1e-5
    C = shape[1]
    x = make_x(shape, dtype, layout, offset, gen)
    x0 = x.double().clone()
    # ---- batch_stats
    if stats:
        mean, var = ops.batch_stats(x)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        assert mean.dtype == acc and var.dtype == acc
        if x0.numel() == 0:
            rm, rv = torch.zeros(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
        else:
            xt = x0.transpose(0, 1).reshape(C, -1)
            rm, rv = xt.mean(1), xt.var(1, unbiased=False)
        t = 1e-12 if dtype == torch.float64 else 1e-5
        close(mean, rm, t, "mean")
        close(var, rv, t, "var")
    # ---- forward_
    mean = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.3).float()
    var = (torch.rand(C, generator=gen, dtype=torch.float64) + 0.5).float()
    weight = torch.randn(C, generator=gen, dtype=torch.float64).float() if affine else None
    if weight is not None and dtype == torch.float64 and C > 0:
        weight[0] = 0.0  # sign(0) = +1; g~ = eps makes xhat ill-conditioned in low precision
    bias = (torch.randn(C, generator=gen, dtype=torch.float64) * 0.5).float() if affine else None
    res = make_x(shape, dtype, layout, offset, gen) if resid else None
    g = gain(weight, C, eps, signed)
    beta = bias.double() if bias is not None else torch.zeros(C, dtype=torch.float64)
    r = 1 / torch.sqrt(var.double() + eps)
    bs = bshape(x0)
    z = (x0 - mean.double().view(bs)) * (g * r).view(bs) + beta.view(bs)
    if res is not None:
        z = z + res.double()
    y_ref = act_fwd(z, act, p)
    mask = ops.forward_(x, mean, var, weight, bias, res, eps, act, p, signed)
    close(x, y_ref, tol_of(dtype), "forward y")
    n = x.numel()
    if act == 3:
        assert mask.dtype == torch.int32 and mask.numel() == (n + 31) // 32
        zm = mem_order(like_layout(z, x))
        want = pack_bits(zm < Z_STAR)
        if dtype == torch.float64:
            assert torch.equal(mask, want), "mask bits"
        else:
            # z rounding may flip bits right at z*
            got = unpack_bits(mask, n)
            bad = (got != (zm < Z_STAR)) & ((zm - Z_STAR).abs() > 1e-4)
            assert not bad.any(), f"mask bits ({int(bad.sum())} wrong)"
            if n % 32:
                assert (int(mask[-1]) & 0xFFFFFFFF) >> (n % 32) == 0, "mask tail bits"
    else:
        assert mask.numel() == 0
    # ---- backward_reduce / backward_input from the stored y
    y = x
    dy = make_x(shape, dtype, layout, 0, gen)
    y64 = y.double()
    left = (z < Z_STAR) if act == 3 else torch.zeros_like(z, dtype=torch.bool)
    if act == 3:
        # use the kernel's mask so both sides solve on the same branch
        left = unpack_bits(mask, n)
        left = torch.as_strided(left, y.shape, y.stride()).clone() if n else left.view(y.shape)
    # same clamp as activations.h (y/a above -1 + tiny, tiny by accumulation type)
    zr = act_inv(y64, left, act, p, tiny=1e-16 if dtype == torch.float64 else 1e-7)
    gz = dy.double() * act_deriv(zr, act, p)
    zc = zr - beta.view(bs)
    if res is not None:
        zc = zc - res.double()
    xhat = zc / g.view(bs)
    dims = [0] + list(range(2, y.dim()))
    sg_ref = gz.sum(dims) if n else torch.zeros(C, dtype=torch.float64)
    sgx_ref = (gz * xhat).sum(dims) if n else torch.zeros(C, dtype=torch.float64)
    sg, sgx = ops.backward_reduce(y, dy, mask, weight, bias, res, eps, act, p, signed)
    tb = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-3}[dtype]
    if act == 3 and dtype != torch.float64:
        tb = max(tb, 2e-3)
    m = max(1, n // max(C, 1))
    close(sg / m, sg_ref / m, tb, "sum_gz")
    close(sgx / m, sgx_ref / m, tb, "sum_gz_xhat")
    mg = torch.randn(C, generator=gen, dtype=torch.float64).float() * 0.1
    mgx = torch.randn(C, generator=gen, dtype=torch.float64).float() * 0.1
    for residual_grad in (False, True):
        dx, dres = ops.backward_input(y, dy, mask, var, weight, bias, res, mg, mgx, eps, act, p, signed, residual_grad)
        assert dx.dtype == y.dtype and dx.shape == y.shape and dx.stride() == y.stride()
        dx_ref = (g * r).view(bs) * (gz - mg.double().view(bs) - xhat * mgx.double().view(bs))
        td = tol_of(dtype) if not (act == 3 and dtype != torch.float64) else max(tol_of(dtype), 3e-3)
        if act == 3 and dtype == torch.float64:
            td = 1e-7
        close(dx, dx_ref, td, "dx")
        if residual_grad:
            assert dres.shape == y.shape and dres.stride() == y.stride()
            close(dres, gz, td, "dresidual")
        else:
            assert dres.numel() == 0


def main():
    quick = "--quick" in sys.argv
    ops = build()
    gen = torch.Generator().manual_seed(0)
    rnd = random.Random(0)
    shapes = [
        (2, 3),
        (5, 64),
        (4, 5, 7),
        (3, 8, 4, 4),
        (2, 16, 3, 5),
        (1, 37, 5, 5),
        (5, 64, 1, 1),
        (2, 1, 33),
        (2, 6, 2, 3, 4),
        (3, 24, 2, 2, 2),
        (6, 40, 9, 9),
        (0, 3, 4),
        (2, 0, 4),
        (2, 3, 0, 4),
    ]
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    # (multiprocessors, gridDim.y cap, fixed-channel block limit)
    configs = [(2, 65535, 8192), (1, 2, 1), (7, 3, 8192)]
    count = 0
    for (sms, gy, fb), shape in itertools.product(configs if not quick else configs[:2], shapes):
        ops.set_config(sms, gy, fb)
        layouts = ["contiguous"] + (["channels_last"] if len(shape) >= 4 else [])
        for layout, dtype in itertools.product(layouts, dtypes):
            for act in (0, 1, 2, 3):
                # vary the remaining options (seeded)
                offset = rnd.choice([0, 0, 1, 3])
                resid = rnd.random() < 0.4
                affine = rnd.random() < 0.8
                signed = rnd.random() < 0.5
                try:
                    check_case(ops, shape, dtype, layout, act, offset, resid, affine, signed, gen,
                               stats=(act == 0 or act == 3))
                except Exception:
                    print(f"FAILED: config sms={sms} max_grid_y={gy} fixed<={fb} shape={shape} {dtype} {layout} act={act} "
                          f"offset={offset} residual={resid} affine={affine} signed={signed}")
                    raise
                count += 1
    # Larger tensors: several chunks per channel in the reductions (with many
    # "multiprocessors") and several grid-stride sweeps (with one).
    big = [(16, 3, 40, 40), (8, 32, 17, 19), (4, 16, 8, 8, 8), (3000, 5), (2, 1000, 3, 1)]
    for (sms, gy, fb), shape in itertools.product([(64, 65535, 8192), (1, 65535, 2)], big):
        ops.set_config(sms, gy, fb)
        layouts = ["contiguous"] + (["channels_last"] if len(shape) >= 4 else [])
        for layout, dtype in itertools.product(layouts, [torch.float64, torch.float32, torch.bfloat16]):
            for act in ((1, 3) if not quick else (3,)):
                try:
                    check_case(ops, shape, dtype, layout, act, rnd.choice([0, 1]), rnd.random() < 0.4, True,
                               rnd.random() < 0.5, gen)
                except Exception:
                    print(f"FAILED: config sms={sms} fixed<={fb} shape={shape} {dtype} {layout} act={act}")
                    raise
                count += 1
    print(f"emulated CUDA kernels: {count} cases passed")


if __name__ == "__main__":
    main()
