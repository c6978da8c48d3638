"""Where a training step's CPU time goes: normalisation + activation, convolution, the rest.

Used by ``bench_models.py --breakdown`` and ``bench_unet.py --breakdown``. Each
variant's step runs a few times under ``torch.profiler.profile()`` (CPU
activity only), the variants in turns as in ``bench_models.time_interleaved``
(the order rotating from one step to the next), after one profiled step of
each that is thrown away (the profiler's first-use costs). Every profiler
event's **self** CPU time (``prof.key_averages()``, time inside the event less
the time in the events nested in it) goes to one class by `classify`, so no
time is counted twice: not the nested ops (``aten::conv2d`` ->
``aten::convolution`` -> ``aten::mkldnn_convolution`` each count only their own
part), and not ranges such as the optimizers' ``Optimizer.step#SGD.step``
(their self time is the optimizer's Python code: other). No schedule is used,
so there are no ``ProfilerStep#`` ranges.

Figures per variant, in ms per step:

  step      : wall clock of a profiled step (``time.perf_counter`` around the
              step call, inside the profiler). It includes the profiler's own
              overhead, so it is longer than the unprofiled step of the timing
              table, which stays the reference for step ratios;
  norm+act  : self time of the events classified ``norm+act``;
  conv      : self time of the events classified ``conv``;
  other     : step - norm+act - conv: the other events' self time plus the
              time in no event at all (Python between ops, given apart as
              ``untraced_ms`` in the JSON).

Derived, per model (`derived`):

  bound            = (stock step - stock norm+act) / stock step: the
                     converted / stock step ratio that a norm+act costing
                     nothing would give, all else equal. If the bound is above
                     a target ratio, no improvement of the normalisation and
                     activation layers alone can meet that target;
  norm+act ours/stock = converted norm+act / stock norm+act;
  floor bound      = (stock step - stock norm+act + floor) / stock step, where
                     floor is the profiled self time of `norm_floor_step`: for
                     every normalisation layer, the least memory traffic any
                     fused in-place layer makes in a training step (x read and
                     y written; y and dy read and dx written), as two bare
                     ATen calls with no statistics and no activation math. A
                     layer that reads and writes those tensors can hardly take
                     less than the floor: the converted step goes below the
                     floor bound only where the rest of the step changes too
                     (a residual addition folded into a layer). Given only
                     where a model's breakdown has a "floor" variant
                     (``bench_models.py``).

Both come from profiled times; the profiler's per-event overhead weighs more
on the many small norm+act events than on the few long convolutions, so the
bound is if anything on the low side (a conservative test).
"""
import re
import time

import torch

CLASSES = ("norm+act", "conv", "other")

# (class, regular expression searched in the event name, case-insensitive, what it is there for).
# The first row that matches decides; a name that no row matches is "other". Not listed, hence
# "other": aten::copy_, aten::add_, aten::empty*, aten::clone, aten::to, aten::mul, aten::where ...
# even where the in-place layers call them (their small copies of weights and statistics, the
# clone of a shortcut input, the elementwise ops in their Python backward), and the optimizer,
# loss, pooling, linear layers and attention.
PATTERNS = (
    ("norm+act", r"inplace_?a[bg]n",
     "our ops inplace_abn::* and autograd nodes _InPlaceABNFunction(Backward), _InPlaceAGNFunction(Backward)"),
    ("norm+act", r"batch_?norm|group_?norm",
     "aten::batch_norm, native_batch_norm(_backward), _batch_norm_impl_index, native_group_norm(_backward), "
     "NativeBatchNormBackward0, CudnnBatchNormBackward0, NativeGroupNormBackward0, _SyncBatchNormFunction"),
    ("norm+act", r"relu|threshold|clamp_min",
     "aten::relu(_), leaky_relu(_backward), threshold_backward, ReluBackward0, LeakyReluBackward0/1; "
     "aten::clamp_min(_) is how the CPU computes relu"),
    ("norm+act", r"silu|sigmoid|\belu",
     "aten::silu(_), silu_backward, SiluBackward0, elu (not gelu/selu/celu); sigmoid(_backward) and "
     "SigmoidBackward0, which in EfficientNet are the squeeze-excitation gates, not part of a norm pair"),
    ("conv", r"conv(olution|\d|_)",
     "aten::conv2d, convolution, _convolution, mkldnn_convolution, convolution_backward, conv_transpose2d, "
     "slow_conv*, ConvolutionBackward0 (not 'convert')"),
)
_COMPILED = tuple((cls, re.compile(rx, re.IGNORECASE)) for cls, rx, _ in PATTERNS)


def classify(event_name: str) -> str:
    """The class of a profiler event (``norm+act``, ``conv`` or ``other``) by `PATTERNS`.

    Autograd's ``autograd::engine::evaluate_function: <node>`` wrappers go with their node
    (the node's name is in theirs).
    """
    for cls, rx in _COMPILED:
        if rx.search(event_name):
            return cls
    return "other"


def _self_times(prof) -> dict:
    """{event name: self CPU microseconds} of a finished profile."""
    return {e.key: e.self_cpu_time_total for e in prof.key_averages()}


def profile_variants(steps, n: int) -> dict:
    """Profile ``n`` calls of each step in ``steps`` ({variant: callable}), in turns.

    Returns {variant: {"steps", "step_ms", "norm+act_ms", "conv_ms", "other_ms", "untraced_ms",
    "events": {name: [self ms per step, class]}}} (see the module docstring).
    """
    from torch.profiler import ProfilerActivity, profile

    names = list(steps)
    wall = {v: 0.0 for v in names}
    events = {v: {} for v in names}
    for r in range(n + 1):  # r == 0: one profiled step of each, not kept
        k = r % len(names)
        for v in names[k:] + names[:k]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                steps[v]()
                dt = time.perf_counter() - t0
            if r == 0:
                continue
            wall[v] += dt
            for name, us in _self_times(prof).items():
                events[v][name] = events[v].get(name, 0.0) + us
    out = {}
    for v in names:
        ev = {name: [us / 1e3 / n, classify(name)] for name, us in sorted(events[v].items(), key=lambda kv: -kv[1])}
        parts = {cls: sum(ms for ms, c in ev.values() if c == cls) for cls in CLASSES}
        step_ms = wall[v] * 1e3 / n
        traced = sum(parts.values())
        out[v] = {"steps": n, "step_ms": step_ms, "norm+act_ms": parts["norm+act"], "conv_ms": parts["conv"],
                  "other_ms": step_ms - parts["norm+act"] - parts["conv"], "untraced_ms": step_ms - traced,
                  "events": ev}
    return out


def norm_floor_step(model: torch.nn.Module, x: torch.Tensor):
    """A callable making the least memory traffic of a fused in-place norm + activation layer's training
    step for every normalisation layer (BatchNorm, GroupNorm) of ``model``, at the shape, dtype and memory
    layout of the layer's input in a forward of ``x``: the input read and the output written over it
    (``y.neg_()``), then y and dy read and dx written (``torch.mul(dy, y, out=dx)``). The forward that
    finds the inputs runs in eval mode under no_grad, so it changes no running statistics. The
    callable's ``tensors`` attribute lists its (y, dy, dx) per layer, in the order the layers ran."""
    from inplace_abn._convert_analysis import is_norm

    inputs = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().clone()))
             for m in model.modules() if is_norm(m)]
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    if not inputs:
        raise ValueError("norm_floor_step: the model has no BatchNorm or GroupNorm layer")
    bufs = [(y, torch.randn_like(y), torch.empty_like(y)) for y in inputs]

    def step():
        for y, dy, dx in bufs:
            y.neg_()
            torch.mul(dy, y, out=dx)

    step.tensors = bufs
    return step


def derived(bd: dict) -> dict:
    """{"bound", "norm_act_ratio"} of one model's breakdown ({"stock": ..., "converted": ...}), and
    "floor_ms", "floor_ratio" (floor / stock norm+act), "floor_bound" where it has a "floor" variant
    (`norm_floor_step` profiled)."""
    s, c = bd["stock"], bd["converted"]
    out = {"bound": (s["step_ms"] - s["norm+act_ms"]) / s["step_ms"],
           "norm_act_ratio": c["norm+act_ms"] / s["norm+act_ms"]}
    if "floor" in bd:
        floor_ms = bd["floor"]["step_ms"] - bd["floor"]["untraced_ms"]  # the two ATen calls' self time
        out.update(floor_ms=floor_ms, floor_ratio=floor_ms / s["norm+act_ms"],
                   floor_bound=(s["step_ms"] - s["norm+act_ms"] + floor_ms) / s["step_ms"])
    return out


def header(n: int) -> str:
    from accuracy_table import cpu_name

    return (f"breakdown: torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_name()}, "
            f"ISA {torch.backends.cpu.get_cpu_capability()}; torch.profiler (CPU activity), {n} profiled steps "
            f"per variant after the timed ones; self CPU time per event, classified by breakdown.classify; "
            f"step = wall clock of a profiled step (profiler overhead included: the timing table above is the "
            f"reference for step ratios); other = step - norm+act - conv")


def table(rows) -> str:
    """Markdown table of ``rows`` [(model label, {variant: profile_variants result})], then per model
    the bound, the norm+act ratio and, with a "floor" variant (not a row), the floor bound."""
    lines = ["| model | variant | step ms (profiled) | norm+act ms | conv ms | other ms | norm+act share |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for label, bd in rows:
        for v, r in bd.items():
            if v == "floor":
                continue
            lines.append(f"| {label} | {v} | {r['step_ms']:.1f} | {r['norm+act_ms']:.1f} | {r['conv_ms']:.1f} | "
                         f"{r['other_ms']:.1f} | {r['norm+act_ms'] / r['step_ms']:.3f} |")
        d = derived(bd)
        note = (f"{label}: bound (converted/stock step with norm+act free) = {d['bound']:.3f}; "
                f"norm+act ours/stock = {d['norm_act_ratio']:.3f}")
        if "floor_bound" in d:
            note += (f"; traffic floor {d['floor_ms']:.1f} ms = {d['floor_ratio']:.3f} "
                     f"of stock norm+act, floor bound (norm+act at the floor) = {d['floor_bound']:.3f}")
        notes.append(note)
    return "\n".join(lines + [""] + notes)
