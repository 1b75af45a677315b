"""The hop worker's CUDA path on one GPU: pipelined stages run on a stream per group, each behind
the caller's stream and the stages it needs, and the caller's stream is behind all of them once
the handle is waited for. One GPU holds no multi-rank group, so the stages here are tensor work
keyed by stand-in groups; the hops' collectives on NCCL need several GPUs."""

from __future__ import annotations

import torch

from deepspeed_ext.zero.engine.hop_worker import HopWorker, Stage


def test_stages_run_on_a_stream_per_group_in_dependency_order():
    device = torch.device("cuda", 0)
    outer, inner = object(), object()  # two groups: two streams
    x = torch.arange(1 << 20, device=device, dtype=torch.float32)
    seen: dict[str, torch.cuda.Stream] = {}
    out = torch.empty_like(x)
    state: list[torch.Tensor] = []

    def first() -> torch.Tensor:
        seen["first"] = torch.cuda.current_stream(device)
        torch.cuda._sleep(50_000_000)  # long enough that a missing wait would be caught
        state.append(x * 2)
        return state[0]

    def second() -> torch.Tensor:
        seen["second"] = torch.cuda.current_stream(device)
        out.copy_(state[0] + 1)
        return out

    worker = HopWorker()
    try:
        handle = worker.submit_stages(device, [Stage(outer, first), Stage(inner, second, (0,))])
        handle.wait()
        torch.testing.assert_close(out, x * 2 + 1)
    finally:
        worker.shutdown()
    caller = torch.cuda.current_stream(device)
    assert len({seen["first"], seen["second"], caller}) == 3
