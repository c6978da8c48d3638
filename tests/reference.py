"""Independent reference: stock torch.nn.functional.batch_norm + activation,
evaluated in float64 with autograd."""
import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "identity": lambda z, p: z,
    "relu": lambda z, p: F.relu(z),
    "leaky_relu": lambda z, p: F.leaky_relu(z, p),
    "elu": lambda z, p: F.elu(z, p),
    "silu": lambda z, p: F.silu(z),
    "swish": lambda z, p: F.silu(z),
}


def effective_weight(w, eps, weight_mode):
    """g~ of DESIGN.md section 1, differentiable in w."""
    a = w.abs() + eps
    if weight_mode == "signed":
        # sign(0) = +1 for the forward; d g~/dw = 1 everywhere.
        sign = torch.where(w < 0, -1.0, 1.0).to(w.dtype)
        return sign * a.detach() + (w - w.detach())
    return a


def stock(x, weight, bias, running_mean, running_var, training=True, momentum=0.1, eps=1e-5,
          activation="leaky_relu", activation_param=0.01, weight_mode="abs", residual=None, dtype=None):
    """Stock BatchNorm + activation in ``dtype`` (default: x's); returns y."""
    dtype = dtype or x.dtype
    w = None if weight is None else effective_weight(weight, eps, weight_mode)
    z = F.batch_norm(x.to(dtype), running_mean, running_var,
                     None if w is None else w.to(dtype) if dtype == torch.float64 else w,
                     None if bias is None else bias.to(dtype) if dtype == torch.float64 else bias,
                     training, momentum, eps)
    if residual is not None:
        z = z + residual.to(dtype)
    return ACTIVATIONS[activation](z, activation_param)


def rel_err(a, ref):
    """Norm-wise relative error of a against ref (float64)."""
    a, ref = a.detach().double(), ref.detach().double()
    den = ref.norm()
    if den == 0:
        return (a - ref).norm().item()
    return ((a - ref).norm() / den).item()
