"""Forward, gradients and running statistics of the in-place layer against
stock BatchNorm + activation in float64 (autograd), for every activation,
weight mode, layout, rank and dtype, on both backends."""
import zlib

import pytest
import torch

from cases import LAYOUTS, make_case, errors, run

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
ACTIVATIONS = ["identity", "leaky_relu", "elu", "silu", "relu"]


ULP = {torch.float32: 1.2e-7, torch.bfloat16: 7.8e-3, torch.float16: 9.8e-4}
PARAM_GRADS = ("dw", "db", "dr")


def bounds(dtype, activation, stock_err, ordinary=True):
    """Largest accepted error per output for a dtype below float64.

    Every output: at most 2x the stock path's error at the same precision
    (never below 2 ulp of the dtype: the stored output the in-place backward
    works from has that resolution) and, in float32 on ordinary data, at most
    1e-5 (silu 5e-6). On hostile data only the stock-relative bound applies.
    Inverting elu's flat tail and SiLU near its minimum is ill-conditioned
    (DESIGN.md section 3): z recovered from a rounded y is several times less
    precise than the stock path's rounded z, which the parameter gradients
    (sums of f'(z) over every element) feel most. For those, the factor is 8
    and SiLU in float32 is held to the design's absolute figures instead.
    """
    out = {}
    for k, s in stock_err.items():
        factor = 8.0 if activation in ("elu", "silu") and k in PARAM_GRADS else 2.0
        rel = max(factor * s, 2 * ULP[dtype])
        if dtype == torch.float32 and ordinary:
            if activation == "silu":
                out[k] = 5e-5 if k in PARAM_GRADS else 5e-6
            else:
                out[k] = min(1e-5, rel)
        else:
            out[k] = rel
    return out


def check(case, layout, activation, weight_mode, training=True, with_residual=False, ordinary=True):
    dtype = case["x"].dtype
    fmt = LAYOUTS[layout][1]
    ours = run(case, "ours", fmt, training, activation, weight_mode, with_residual)
    ref = run(case, "stock", fmt, training, activation, weight_mode, with_residual, dtype=torch.float64)
    err = errors(ours, ref)
    if dtype == torch.float64:
        bad = {k: e for k, e in err.items() if e > 1e-10}
        assert not bad, f"float64 errors above 1e-10: {bad}"
        return err
    stock_err = errors(run(case, "stock", fmt, training, activation, weight_mode, with_residual), ref)
    limit = bounds(dtype, activation, stock_err, ordinary)
    bad = {k: (e, stock_err[k], limit[k]) for k, e in err.items() if e > limit[k]}
    assert not bad, f"{dtype} {activation}: errors above bound (ours, stock, bound): {bad}"
    return err


def seed_of(*key):
    return zlib.crc32(repr(key).encode()) % 10000


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("weight_mode", ["abs", "signed"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_training_matches_stock(backend, activation, weight_mode, layout, dtype):
    case = make_case(LAYOUTS[layout][0], dtype, seed=seed_of(activation, weight_mode, layout, dtype))
    check(case, layout, activation, weight_mode)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["2d", "4d", "4d_channels_last", "5d_channels_last_3d"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_eval_matches_stock(backend, activation, layout, dtype):
    case = make_case(LAYOUTS[layout][0], dtype, seed=7)
    check(case, layout, activation, "abs", training=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["4d", "4d_channels_last"])
@pytest.mark.parametrize("activation", ["leaky_relu", "silu", "elu"])
@pytest.mark.parametrize("training", [True, False])
def test_residual_matches_stock(backend, activation, layout, dtype, training):
    case = make_case(LAYOUTS[layout][0], dtype, seed=3)
    check(case, layout, activation, "signed", training=training, with_residual=True)


HOSTILE = {
    "mean_1e4": dict(mean_scale=1e4),
    "tiny_variance": dict(std=1e-3, mean_scale=1.0),
    "large_batch": dict(),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["leaky_relu", "silu", "elu"])
@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_hostile_data(backend, hostile, activation, dtype):
    shape = (4096, 3, 8, 8) if hostile == "large_batch" and dtype != torch.float64 else (8, 3, 9, 9)
    if hostile == "large_batch" and dtype == torch.float64:
        shape = (1024, 3, 8, 8)
    kwargs = HOSTILE[hostile]
    case = make_case(shape, dtype, seed=11, **kwargs)
    if hostile == "mean_1e4":
        case["rm"] = case["rm"] + 1e4
    # A large batch of ordinary data keeps the ordinary bounds.
    err = check(case, "4d", activation, "abs", ordinary=hostile == "large_batch")
    assert all(e == e and e < float("inf") for e in err.values()), f"non-finite error {err}"
