"""torch.library.opcheck for every native operator: schema (including the
mutation annotation of forward_), fake kernels, and AOT dispatch, in
training and eval signatures, for every activation and both layouts."""
import pytest
import torch

import inplace_abn
from inplace_abn import _activation

pytestmark = pytest.mark.skipif(not inplace_abn.HAS_NATIVE, reason="native extension not built")


def _args(act, fmt, residual, dtype=torch.float32, training=True):
    g = torch.Generator().manual_seed(act)
    shape = (3, 5, 4, 6)
    x = torch.randn(shape, generator=g, dtype=dtype).contiguous(memory_format=fmt)
    C = shape[1]
    w = torch.rand(C, generator=g) + 0.5
    b = torch.randn(C, generator=g)
    r = torch.randn(shape, generator=g, dtype=dtype).contiguous(memory_format=fmt) if residual else None
    mean, var = torch.ops.inplace_abn.batch_stats(x)
    if not training:
        mean, var = torch.randn(C, generator=g) * 0.1, torch.rand(C, generator=g) + 0.5
    p = {_activation.LEAKY_RELU: 0.1, _activation.ELU: 1.0}.get(act, 0.0)
    return x, mean, var, w, b, r, p


ACTS = [_activation.IDENTITY, _activation.LEAKY_RELU, _activation.ELU, _activation.SILU]
FORMATS = [torch.contiguous_format, torch.channels_last]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("act", ACTS)
def test_opcheck_all_operators(act, fmt, training, residual):
    ops = torch.ops.inplace_abn
    x, mean, var, w, b, r, p = _args(act, fmt, residual, training=training)
    torch.library.opcheck(ops.batch_stats.default, (x,))
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, w, b, r, 1e-5, act, p, True))
    y = x.clone()
    mask = ops.forward_(y, mean, var, w, b, r, 1e-5, act, p, False)
    dy = torch.randn_like(y)
    torch.library.opcheck(ops.backward_reduce.default, (y, dy, mask, w, b, r, 1e-5, act, p, False))
    s_g, s_gx = ops.backward_reduce(y, dy, mask, w, b, r, 1e-5, act, p, False)
    n = x.numel() // x.shape[1]
    mg, mgx = (s_g / n, s_gx / n) if training else (torch.zeros_like(s_g), torch.zeros_like(s_gx))
    torch.library.opcheck(ops.backward_input.default,
                          (y, dy, mask, var, w, b, r, mg, mgx, 1e-5, act, p, False, residual))


def test_opcheck_optional_affine_and_half():
    ops = torch.ops.inplace_abn
    x, mean, var, _, _, _, _ = _args(_activation.SILU, torch.contiguous_format, False, dtype=torch.bfloat16)
    torch.library.opcheck(ops.batch_stats.default, (x,))
    torch.library.opcheck(ops.forward_.default, (x.clone(), mean, var, None, None, None, 1e-5, 3, 0.0, False))
