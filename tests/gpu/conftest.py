"""GPU tests: skipped where CUDA is absent (CI); ``cuda_rank`` is a one-rank NCCL job with
megatron-core's parallel state at TP=1, shared by the tests of a session."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `bash scripts/run_gpu.sh` on a GPU node)")
    for item in items:
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_rank() -> Iterator[torch.device]:
    """This process as rank 0 of 1 on NCCL, TP=1, CUDA RNG seeded as the main job does."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    store = f"file://{tempfile.mkdtemp(prefix='gpu-tests-')}/rendezvous"
    dist.init_process_group("nccl", init_method=store, rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)
    yield torch.device("cuda", 0)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
