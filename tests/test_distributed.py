"""InPlaceABNSync / inplace_abn_sync / ABNSync / convert_sync on torch.distributed
(gloo, CPU): W ranks with uneven batches (one of them empty) against ONE
process running stock float64 BatchNorm + activation on the concatenated batch,
a DistributedDataParallel training run, the protocol's collectives, and the
error paths (global count 1, channel or precision mismatch, eval without
collectives, a rank that dies).

All multi-process checks share one launch of 4 ranks (tests/dist_worker.py):
world sizes 1-3 run on subgroups, 4 on the default group. The launch has a
deadline and every process group a timeout, so a hang fails the tests instead
of blocking CI.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dist_worker
import inplace_abn
from inplace_abn import ABN, InPlaceABN, InPlaceABNSync, convert_sync
from inplace_abn.sync import ABNSync
from reference import rel_err

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}
# Float32 SiLU, synchronised, against one float64 process: z recovered near the SiLU minimum is
# ill-conditioned, so the errors have a long tail. Worst of 400 runs (2 ranks with batches 5 and
# 3, 200 seeds x 2 weight modes, both backends): at 16 x 14 x 14 dx 4.4e-6, dw 5.9e-6, db 4.5e-6;
# on 5 channels of 4 x 3 / 3 x 5 and 1 / 3 samples, dx 1.3e-5, dw 2.9e-5, db 3.3e-5.
SILU_14X14 = {"dx": 5e-6, "dw": 6e-6, "db": 6e-6}
SILU_TINY = {"dx": 1.5e-5, "dw": 4e-5, "db": 4e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return dist_worker.launch(str(tmp_path_factory.mktemp("dist")))


def reports(runs, name, size):
    got = runs[name]
    meta = runs["_meta"]
    assert sorted(got) == list(range(size)), f"{name}: reports from ranks {sorted(got)} only; launch: {meta}"
    for rank, rep in got.items():
        assert rep["ok"], f"{name} failed on rank {rank}: {rep['error']}\n{rep.get('traceback', '')}"
    return got


def test_launch_finished(runs):
    meta = runs["_meta"]
    assert meta["killed"] == [], f"ranks hung and were killed at the deadline: {meta}"
    # the last rank exits on purpose in the final scenario; the others finish every scenario
    assert meta["done"][:-1] == [True] * (dist_worker.WORLD - 1), meta
    assert meta["exitcodes"] == [0] * dist_worker.WORLD, meta


@pytest.mark.parametrize("case", dist_worker.ACCURACY, ids=[c["name"] for c in dist_worker.ACCURACY])
def test_matches_one_process_on_concatenated_batch(runs, case):
    """Output, dx, the SUM over ranks of the local dweight/dbias (data parallel: the loss is
    the sum of the ranks' losses), dresidual and running statistics, against stock float64
    F.batch_norm + activation on all ranks' inputs in one process. In float32 the bound is
    1e-5, except the SiLU parameter gradients (5e-5, as in tests/test_accuracy.py: z recovered
    near the SiLU minimum is ill-conditioned); bfloat16/float16 only check that synchronising adds
    nothing beyond their rounding (tests/test_accuracy.py bounds them against the stock path).
    SiLU in float32 on these tiny inputs (a few dozen values per channel): dx 1.5e-5, parameters
    4e-5 (the worst of 400 runs: 1.3e-5 and 3.3e-5, see SILU_TINY)."""
    got = reports(runs, case["name"], case["w"])
    tol = TOL[case["dtype"]]
    param_tol = tol
    if case["dtype"] == "float32" and case["act"] == "silu":
        tol, param_tol = SILU_TINY["dx"], SILU_TINY["dw"]
    for rank, rep in got.items():
        bad = {k: e for k, e in rep["errors"].items()
               if not e <= (param_tol if k in ("dw", "db", "dweight", "dbias") else tol)}
        assert not bad, f"rank {rank}: errors above {tol}: {bad}"
        assert rep["running_stats_identical"], "running statistics differ between ranks"
        assert rep["in_place"] and rep["dx_shape_ok"]
    if case["w"] > 2:
        assert got[1]["local_count"] == 0  # rank 1 had an empty batch and took part all the same
    elif case["w"] == 2:  # both ranks hold data: the result needs the other rank's statistics
        assert got[0]["local_count"] > 0 and got[1]["local_count"] > 0


def test_silu_float32_bound(runs):
    """The float32 SiLU bound the README states for the synchronised layer, on SILU_SEEDS
    seeds x 2 weight modes x both backends at 16 x 14 x 14 (batches 5 and 3)."""
    got = reports(runs, "silu-float32-seeds", 2)
    worst = got[0]["worst"]
    for key, e in worst.items():
        what = key.split(":")[1]
        bound = SILU_14X14.get(what, TOL["float32"])
        assert e <= bound, (key, e, bound)
    assert any(k.startswith("native:") for k in worst) == inplace_abn.HAS_NATIVE


def test_several_forwards_per_step(runs):
    got = reports(runs, "two-forwards-one-backward", 3)
    for rep in got.values():
        assert max(rep["errors"].values()) < 1e-10, rep["errors"]
        assert rep["running_stats_identical"] and rep["num_batches_tracked"] == 2


def test_abn_sync_is_exactly_abn(runs):
    got = reports(runs, "abnsync-exact", 3)
    for case, errs in got[0]["errors"].items():
        assert max(errs.values()) < TOL[case.split("-")[1]], (case, errs)


def test_sync_preserve_input_matches_one_process(runs):
    for rep in reports(runs, "preserve-input", 2).values():
        assert rep["unchanged"] == [True, True], rep  # x as it was, a new output
        assert max(rep["errors"].values()) < 1e-10, rep["errors"]


def test_ddp_training(runs):
    """2 ranks, uneven micro-batches, gradient accumulation with no_sync, buffers broadcast:
    loss goes down, parameters and buffers equal on both ranks and equal to one process
    training on the whole batch (float64)."""
    got = reports(runs, "ddp-training", 2)
    for rank, rep in got.items():
        losses = rep["losses"]
        assert losses[-1] < 0.8 * losses[0], losses
        assert max(abs(a - b) / b for a, b in zip(losses, rep["ref_losses"])) < 1e-10
        assert rep["identical"], f"rank {rank}: parameters or buffers differ between ranks"
        bad = {k: e for k, e in rep["errors"].items() if not e < 1e-10}
        assert not bad, f"rank {rank}: differs from the single-process run: {bad}"
        assert "InPlaceABNSync" in rep["types"] and "ABNSync" in rep["types"]
        assert "InPlaceABN" not in rep["types"] and "ABN" not in rep["types"]


@pytest.mark.parametrize("world", [2, 4])
def test_one_collective_per_forward_and_backward(runs, world):
    got = reports(runs, f"protocol-w{world}", world)
    C = got[0]["C"]
    for rank, rep in got.items():
        for dt, steps in rep["steps"].items():
            sums = "torch.float64" if dt == "torch.float64" else "torch.float32"
            # header (11 values) + statistics (2C + 1) in one all_reduce; the group's very first
            # call (float32, step 0) had no agreed length yet: the header alone, then the 2C + 1
            H = inplace_abn._distributed.HEADER
            assert H == 11
            stats = [["all_reduce", H + 2 * C + 1, "torch.float64"]]
            for i, s in enumerate(steps):
                if dt == "torch.float32" and i == 0:
                    assert s["forward"] == [["all_reduce", H, "torch.float64"],
                                            ["all_reduce", 2 * C + 1, "torch.float64"]], (rank, s)
                else:
                    assert s["forward"] == stats, (rank, dt, s)
                assert s["backward"] == [["all_reduce", 2 * C, sums]], (rank, dt, s)
            if rank == 1:
                assert steps[0]["dx_shape"][0] == 0  # the empty rank gets an empty gradient


def test_synchronised_step_reads_nothing_to_the_host(runs):
    """No .item() / .tolist() / bool() / int() / float() (nor aten._local_scalar_dense) in a
    synchronised forward or backward: the agreement and count checks are device asserts
    (channels, precision, n != 1: three per forward), the global count stays a tensor."""
    got = reports(runs, "no-host-sync", 2)
    for rank, rep in got.items():
        assert sorted(rep["cases"]) == ["ABNSync-3", "ABNSync-9", "InPlaceABNSync-3", "InPlaceABNSync-9",
                                        "functional"], rep
        for case, r in rep["cases"].items():
            assert r["forward"] == [] and r["backward"] == [], (rank, case, r)
            assert r["asserts"] == 3, (rank, case, r)


def test_global_count_of_one_raises_on_every_rank(runs):
    got = reports(runs, "count-one", 2)
    for key in ("error", "error_functional"):
        for rep in got.values():
            assert rep[key] is not None and rep[key].startswith(
                "ValueError: Expected more than 1 value per channel when training, got 1 "), rep[key]
    assert all(rep["after"] is None for rep in got.values()), "the group fell out of step after the error"


def test_channel_mismatch_raises_on_every_rank(runs):
    got = reports(runs, "channel-mismatch", 2)
    for rank, rep in got.items():
        for key in ("module", "functional", "model"):
            assert rep[key] is not None and "ranks disagree on the channel count" in rep[key], (rank, key, rep[key])
            assert rep[key].startswith("ValueError")
        assert rep["dtype"] is not None and "ranks disagree on the input precision" in rep["dtype"], rep["dtype"]
        assert rep["after"] is None, "the group fell out of step after the error"


def test_refused_input_raises_on_every_rank(runs):
    """A rank refusing its input before the all_reduce must still take part in it: before, it
    raised alone and the others' all_reduce paired with its next call (on gloo, the statistics
    of two calls mixed without an error: rank 0's "channels" call returned normally)."""
    got = reports(runs, "refused-input", 2)
    refused = "or a rank refused its input"
    assert got[1]["channels"].startswith("ValueError: inplace_abn: the input has 6 channels"), got[1]
    assert refused in got[0]["channels"] and got[0]["channels"].startswith(CHANNELS), got[0]
    assert got[0]["dtype"].startswith("TypeError: inplace_abn: expected a floating point input"), got[0]
    assert refused in got[1]["dtype"] and got[1]["dtype"].startswith(CHANNELS), got[1]
    for rank in (0, 1):
        assert got[rank]["every-rank"].startswith("ValueError: inplace_abn: the input has 5 channels"), got[rank]
        assert got[rank]["after"] is None, "the group fell out of step after the refusal"


@pytest.fixture(scope="module")
def mismatch_runs(tmp_path_factory):
    return dist_worker.launch(str(tmp_path_factory.mktemp("mismatch")), world=2, suite="mismatch",
                              deadline_s=90)


CHANNELS = "ValueError: InPlaceABNSync: ranks disagree on the channel count"
PRECISION = "ValueError: InPlaceABNSync: ranks disagree on the input precision"


def _same_error_everywhere(got, case, expected):
    """case: {agree: [errors], disagree: error, after: error} per rank; the disagreeing call
    raises ``expected`` on every rank, the others pass, nobody is killed."""
    for rank, rep in got.items():
        r = rep
        for k in case:
            r = r[k]
        assert r["agree"] == [None] * len(r["agree"]), (rank, case, r)
        keys = [k for k in r if k.startswith("disagree")]
        for k in keys:
            assert r[k] is not None and r[k].startswith(expected), (rank, case, k, r[k])
        assert r["after"] is None, (rank, case, "the group fell out of step after the error", r["after"])


def test_mismatch_launch_finished(mismatch_runs):
    meta = mismatch_runs["_meta"]
    assert meta["killed"] == [] and meta["exitcodes"] == [0, 0] and meta["done"] == [True, True], meta


def test_channel_change_without_tensors_raises_on_every_rank(mismatch_runs):
    """A functional call with no tensors, and layers with affine=False and no running
    statistics, agreeing on C = 3 and C = 5, then 3 against 5, then 3 against 40: before the
    fix the ranks skipped their one-time check and gloo aborted one of them (SIGABRT)."""
    got = reports(mismatch_runs, "mismatch-functional-no-tensors", 2)
    _same_error_everywhere(got, [], CHANNELS)
    got = reports(mismatch_runs, "mismatch-module-no-stats", 2)
    for cls in ("InPlaceABNSync", "ABNSync"):
        _same_error_everywhere(got, [cls], CHANNELS)


def test_precision_switch_raises_on_every_rank(mismatch_runs):
    """One rank switches a layer (or the functional call) to float64 after agreeing calls."""
    got = reports(mismatch_runs, "mismatch-dtype-switch", 2)
    for case in ("InPlaceABNSync", "ABNSync", "functional"):
        _same_error_everywhere(got, [case], PRECISION)


def test_any_call_sequence_stays_in_step(mismatch_runs):
    got = reports(mismatch_runs, "mismatch-random-sequence", 2)
    res = [got[r]["results"] for r in (0, 1)]
    assert res[0] == res[1], "the ranks saw different outcomes"
    raised = [r for r in res[0] if r[0] == "raised"]
    assert all(r == ["raised", CHANNELS.split(": ", 1)[1]] for r in raised), raised
    assert ["ok", True] not in res[0], "a disagreeing call went through"
    assert len(raised) >= 8 and len(res[0]) == 80
    assert max(got[r]["max_err"] for r in (0, 1)) < 1e-12


def test_eval_runs_no_collective(runs):
    """Rank 0 alone runs eval passes (InPlaceABNSync, ABNSync with and without running
    statistics, the functional form, a converted model) while the others wait: it returns,
    having called no collective."""
    got = reports(runs, "eval-on-rank-0-only", dist_worker.WORLD)
    assert got[0]["collectives"] == []


def test_eval_with_batch_statistics_runs_no_collective(runs):
    got = reports(runs, "eval-track-running-stats-false", 2)
    assert got[0]["collectives"] == [] and got[1]["collectives"] == []


def test_rank_outside_the_group_is_refused(runs):
    got = reports(runs, "not-a-member", dist_worker.WORLD)
    for rank in range(1, dist_worker.WORLD):
        assert "is not a member of the layer's process group" in got[rank]["error"]


def test_dead_rank_fails_the_others(runs):
    """The last rank exits between forward and backward: the others get an error, within
    the group's timeout, instead of hanging."""
    got = runs["rank-dies-mid-step"]
    assert sorted(got) == list(range(dist_worker.WORLD - 1)), runs["_meta"]
    for rank, rep in got.items():
        assert rep["ok"] and rep["error"] is not None, rep
        assert rep["error"].startswith(("RuntimeError", "DistBackendError")), rep
        assert rep["seconds"] < rep["timeout"] + 5, rep


# ---- without a process group ----------------------------------------------------------

def _model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 1), InPlaceABN(4, activation="elu", activation_param=0.5, weight_mode="signed", eps=1e-3),
        nn.Sequential(ABN(4, activation="relu", momentum=None), InPlaceABN(4, affine=False, track_running_stats=False)),
        ABN(4, activation="silu", momentum=0.3),
    )


def test_convert_sync_keeps_tensors_and_settings():
    model = _model().eval()
    before = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, ABN)}
    group = object()
    out = convert_sync(model, group)
    assert out is model
    for name, m in out.named_modules():
        if name in layers:
            old = layers[name]
            assert type(m) is (InPlaceABNSync if isinstance(old, InPlaceABN) else ABNSync), name
            assert m.group is group and not m.training
            for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "activation",
                         "activation_param"):
                assert getattr(m, attr) == getattr(old, attr), (name, attr)
            if isinstance(old, InPlaceABN):
                assert m.weight_mode == old.weight_mode
    after = {n: t for n, t in list(out.named_parameters()) + list(out.named_buffers())}
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert list(out.state_dict()) == list(_model().state_dict())


def test_convert_sync_single_layer_and_inplace_option():
    abn = ABN(6, activation="leaky_relu", activation_param=0.2)
    layer = convert_sync(abn, abn="inplace")
    assert type(layer) is InPlaceABNSync and layer.weight_mode == "signed" and layer.weight is abn.weight
    assert type(convert_sync(InPlaceABNSync(3))) is InPlaceABNSync
    # an input read again stays unwritten in the synchronised layer
    assert convert_sync(InPlaceABN(3, preserve_input=True)).preserve_input
    assert not convert_sync(InPlaceABN(3)).preserve_input
    with pytest.raises(ValueError, match="abn must be 'exact' or 'inplace'"):
        convert_sync(abn, abn="approximate")


def test_abn_conversions_without_process_group(backend, monkeypatch):
    """No process group: ABNSync runs ABN exactly (one warning); the 'inplace' conversion
    scales by sign(w)(|w| + eps) instead of w: a relative difference of about eps/|w|."""
    import inplace_abn.functions as fn
    import inplace_abn.sync as sync

    monkeypatch.setattr(sync, "_warned_no_dist", False)
    monkeypatch.setattr(fn, "_warned_no_dist", True)
    torch.manual_seed(0)
    abn = ABN(5, activation="elu", activation_param=0.7).double()
    with torch.no_grad():
        abn.weight.copy_(torch.rand(5) + 0.5), abn.bias.copy_(torch.randn(5))
    x = torch.randn(6, 5, 3, 3, dtype=torch.float64) * 2 + 1
    ref = F.elu(F.batch_norm(x, None, None, abn.weight, abn.bias, True, 0.1, abn.eps), 0.7)
    exact = convert_sync(ABN(5, activation="elu", activation_param=0.7).double())
    exact.load_state_dict(abn.state_dict())
    with pytest.warns(RuntimeWarning, match="not initialized"):
        y = exact(x.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact(x.clone())  # warns once
    assert rel_err(y, ref) < 1e-14
    approx = convert_sync(abn, abn="inplace")
    err = rel_err(approx(x.clone()), ref)
    assert 1e-7 < err < 3 * abn.eps / abn.weight.abs().min().item()


def test_sync_layers_in_eval_need_no_process_group(backend):
    x = torch.randn(4, 3, 2, 2)
    for layer in (InPlaceABNSync(3), ABNSync(3)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # eval: not even the fallback warning path matters
            assert torch.isfinite(layer.eval()(x.clone())).all()


@pytest.mark.parametrize("cls", [ABNSync, InPlaceABNSync])
def test_sync_layers_take_factory_kwargs(cls):
    """device= and dtype= as in torch.nn.BatchNorm2d: parameters and buffers made there."""
    for kw in (dict(device="meta", dtype=torch.float64), dict(dtype=torch.float16), dict(device="cpu")):
        ref = nn.BatchNorm2d(4, **kw)
        layer = cls(4, activation="identity", **kw)
        for name, t in list(ref.named_parameters()) + list(ref.named_buffers()):
            ours = getattr(layer, name)
            assert (ours.device, ours.dtype, ours.shape) == (t.device, t.dtype, t.shape), (kw, name)


def test_exported():
    assert inplace_abn.convert_sync is convert_sync
