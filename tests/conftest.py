import getpass
import os
import tempfile

# Inductor's caches do not key generated CPU code on ATEN_CPU_CAPABILITY: code
# generated for AVX512 (16 lanes), reused from the cache in a run with
# ATEN_CPU_CAPABILITY=avx2, is compiled for 8 lanes and gives NaNs (seen in
# test_compile.py::test_inductor_train_step; a fresh cache passes). One cache
# per capability, unless the caller chose a cache directory. Set before torch
# is imported: importing torch._inductor fixes the directory (so torch's own
# default_cache_dir cannot be called first; its naming is followed here).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    try:
        _user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        _user = str(os.getpid())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{_user}_{os.environ['ATEN_CPU_CAPABILITY']}")

import pytest  # noqa: E402
import torch  # noqa: E402

import inplace_abn  # noqa: E402

BACKENDS = ["python"] + (["native"] if inplace_abn.HAS_NATIVE else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    config.addinivalue_line("markers", "slow: multi-process or long-running test")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once per available backend."""
    with inplace_abn.use_backend(request.param):
        yield request.param


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this process alone: the synchronised layers' real path."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _threads():
    # Two threads: the CI machine's cores, and a fixed count for reproducibility.
    torch.set_num_threads(2)
    yield
