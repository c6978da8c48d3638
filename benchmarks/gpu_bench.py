"""GPU benchmark of In-Place ABN (docs/DESIGN.md sections 5 and 6).

1. Speed: forward + backward of one layer, timed with CUDA events (warm-up,
   median of repeats), for
     - the in-place layer (inplace_abn.functions.inplace_abn, training mode),
     - stock torch.nn.functional.batch_norm (cuDNN) + the same activation,
     - 4 x.clone() (8 passes over memory: the floor of the fused layer),
   for leaky_relu and silu, float32 and bfloat16, contiguous and channels_last,
   at ResNet-like shapes; printed as times and ratios.
2. Memory: torch.cuda.max_memory_allocated() over one training step of
   torchvision's resnet50, stock vs converted (inplace_abn.convert_model), the
   step's time (median of 10), and the largest batch that fits in a memory cap.

    python benchmarks/gpu_bench.py [--quick] [--repeats N] [--no-resnet] [--no-search] [--mem-gb G]
"""
import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14)]
QUICK_SHAPES = [(32, 256, 56, 56)]


def timed(fn, prepare, warmup, repeats):
    """Median milliseconds of fn(prepare()) over `repeats` runs (prepare is untimed)."""
    for _ in range(warmup):
        fn(prepare())
    times = []
    for _ in range(repeats):
        args = prepare()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stock_act(y, activation, param):
    if activation == "leaky_relu":
        return F.leaky_relu(y, param)
    if activation == "silu":
        return F.silu(y)
    if activation == "elu":
        return F.elu(y, param)
    return y


def layer_fns(shape, dtype, memory_format, activation, param):
    """(prepare, run) pairs of one training step (forward + backward) of the in-place
    layer, of stock batch_norm + activation, and of 4 clones (the floor)."""
    from inplace_abn.functions import inplace_abn

    dev = torch.device("cuda")
    C = shape[1]
    base = torch.randn(shape, device=dev, dtype=dtype).contiguous(memory_format=memory_format)
    dy = torch.randn(shape, device=dev, dtype=dtype).contiguous(memory_format=memory_format)
    weight = torch.rand(C, device=dev, dtype=torch.float32).add_(0.5).requires_grad_()
    bias = torch.randn(C, device=dev, dtype=torch.float32).requires_grad_()
    rm = torch.zeros(C, device=dev, dtype=torch.float32)
    rv = torch.ones(C, device=dev, dtype=torch.float32)

    # In-place layer: its input must be a fresh non-leaf each time (it is
    # overwritten); the copy is made outside the timed region.
    leaf = base.clone().requires_grad_()

    def run_inplace(x):
        y = inplace_abn(x, weight, bias, rm, rv, training=True, momentum=0.1, eps=1e-5, activation=activation,
                        activation_param=param)
        # with respect to the clone's source: x itself now holds y, and its gradient is dy
        torch.autograd.grad(y, (leaf, weight, bias), dy)

    xs = base.clone().requires_grad_()

    def run_stock(x):
        y = F.batch_norm(x, rm, rv, weight, bias, training=True, momentum=0.1, eps=1e-5)
        y = stock_act(y, activation, param)
        torch.autograd.grad(y, (x, weight, bias), dy)

    def run_floor(x):
        for _ in range(4):
            x.clone()

    return {"inplace": (leaf.clone, run_inplace), "stock": (lambda: xs, run_stock), "floor": (lambda: base, run_floor)}


def bench_layer(shape, dtype, memory_format, activation, param, warmup, repeats):
    fns = layer_fns(shape, dtype, memory_format, activation, param)
    t_floor = timed(fns["floor"][1], fns["floor"][0], warmup, repeats)
    t_stock = timed(fns["stock"][1], fns["stock"][0], warmup, repeats)
    try:
        t_inplace = timed(fns["inplace"][1], fns["inplace"][0], warmup, repeats)
    except Exception as e:  # report and go on with the other configurations
        print(f"    in-place layer failed: {type(e).__name__}: {e}")
        t_inplace = float("nan")
    return t_inplace, t_stock, t_floor


def launches(args):
    """GPU kernels of one training step of one layer (torch.profiler), and the host's
    time per step: a layer bound by the host leaves the GPU idle between launches."""
    from torch.profiler import ProfilerActivity, profile

    print("== kernels per training step of one layer (torch.profiler), host time per step")
    shape = QUICK_SHAPES[0]
    for activation, param in (("leaky_relu", 0.01), ("silu", 0.0)):
        fns = layer_fns(shape, torch.float32, torch.channels_last, activation, param)
        for name in ("inplace", "stock"):
            prepare, run = fns[name]
            for _ in range(3):
                run(prepare())
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(prepare())
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            inputs = [prepare() for _ in range(args.repeats)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for x in inputs:
                run(x)
            host = (time.perf_counter() - t0) / len(inputs) * 1e3
            torch.cuda.synchronize()
            print(f"{str(shape):>20} float32 channels_last {activation:>10} {name:>8}: {len(kernels):3d} kernels,"
                  f" host {host:.3f} ms/step", flush=True)
            if name == "inplace":
                short = [k.replace("void ", "").replace("(anonymous namespace)::", "").split("<")[0].split("(")[0]
                         for k in kernels]
                print("    " + ", ".join(f"{k} x{short.count(k)}" for k in sorted(set(short))))
            del inputs


def speed(args):
    shapes = QUICK_SHAPES if args.quick else SHAPES
    print("== forward + backward of one layer (median ms; ratios to 4 clones and to stock)")
    print(f"{'shape':>20} {'dtype':>9} {'format':>14} {'act':>10} | {'inplace':>8} {'stock':>8} {'4clones':>8} |"
          f" {'ip/floor':>8} {'st/floor':>8} {'ip/stock':>8}")
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for fmt_name, fmt in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
                for activation, param in (("leaky_relu", 0.01), ("silu", 0.0)):
                    ti, ts, tf = bench_layer(shape, dtype, fmt, activation, param, args.warmup, args.repeats)
                    print(f"{str(shape):>20} {str(dtype).replace('torch.', ''):>9} {fmt_name:>14} {activation:>10} |"
                          f" {ti:8.3f} {ts:8.3f} {tf:8.3f} | {ti / tf:8.2f} {ts / tf:8.2f} {ti / ts:8.2f}",
                          flush=True)
                    torch.cuda.empty_cache()


def train_step_peak(model, batch, channels_last):
    dev = torch.device("cuda")
    x = torch.randn(batch, 3, 224, 224, device=dev)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # one step first: cuDNN's autotuning (benchmark mode) tries algorithms with large
    # workspaces on a shape's first step, which would count for whichever model runs first
    model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = model(x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, x
    model.zero_grad(set_to_none=True)
    return peak


def fits(model, batch, channels_last):
    try:
        train_step_peak(model, batch, channels_last)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def largest_batch(model, channels_last, start=64, limit=4096, resolution=16):
    lo, hi = 0, start
    while hi <= limit and fits(model, hi, channels_last):
        lo, hi = hi, hi * 2
    if hi > limit:
        return f">= {lo}"
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // resolution * resolution or resolution
        if mid <= lo:
            break
        if fits(model, mid, channels_last):
            lo = mid
        else:
            hi = mid
    return str(lo)


def memory(args):
    print("== resnet50 training step: peak memory (max_memory_allocated - allocated before)")
    try:
        import torchvision
    except ImportError:
        print("torchvision not available: skipped")
        return
    try:
        from inplace_abn import convert_model
    except ImportError:
        convert_model = None
    total = torch.cuda.get_device_properties(0).total_memory
    frac = min(1.0, args.mem_gb * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(frac)
    print(f"memory cap for the largest-batch search: {args.mem_gb:.0f} GiB ({frac:.2f} of the device)")
    dev = torch.device("cuda")
    batch = 64
    models = [("stock", lambda: torchvision.models.resnet50())]
    if convert_model is None:
        print("converter not available (inplace_abn.convert_model): only the stock model is measured")
    else:
        models.append(("converted", lambda: convert_model(torchvision.models.resnet50())))
    results = {}
    for name, make in models:
        for cl in (False, True):
            try:
                model = make().to(dev).train()
                if cl:
                    model = model.to(memory_format=torch.channels_last)
                peak = train_step_peak(model, batch, cl)
                x = torch.randn(batch, 3, 224, 224, device=dev)
                x = x.contiguous(memory_format=torch.channels_last) if cl else x
                step = timed(lambda _: model(x).float().sum().backward(), lambda: None, 3, 10)
                model.zero_grad(set_to_none=True)
                del x
                t0 = time.time()
                lb = "skipped" if args.quick or args.no_search else largest_batch(model, cl)
                key = f"{name}{' channels_last' if cl else ''}"
                results[key] = peak
                print(f"{key:>26}: peak {peak / 2**30:7.2f} GiB at batch {batch}, step {step:7.2f} ms;"
                      f" largest batch {lb} ({time.time() - t0:.0f} s search)", flush=True)
            except Exception as e:
                print(f"{name} (channels_last={cl}) failed: {type(e).__name__}: {e}")
            finally:
                model = None
                torch.cuda.empty_cache()
    for suffix in ("", " channels_last"):
        if f"stock{suffix}" in results and f"converted{suffix}" in results:
            print(f"converted / stock peak{suffix}: {results[f'converted{suffix}'] / results[f'stock{suffix}']:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-resnet", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-search", action="store_true", help="peak memory only, no largest-batch search")
    ap.add_argument("--mem-gb", type=float, default=40.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 1
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    torch.backends.cudnn.benchmark = True
    import inplace_abn  # noqa: F401  (fails loudly if the package is missing)

    if not args.no_speed:
        speed(args)
        try:
            launches(args)
        except Exception as e:  # (profiler trouble must not cost the memory figures)
            print(f"kernel count failed: {type(e).__name__}: {e}")
    if not args.no_resnet:
        memory(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
