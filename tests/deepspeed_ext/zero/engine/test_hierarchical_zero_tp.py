"""TP=2 through megatron-core at 8 ranks: the data-parallel groups {0,2,4,6} and {1,3,5,7} are strided,
so every level is cut from them (hpZ's consecutive-rank groups would be the TP pairs here)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost import volume as cm
from deepspeed_ext.zero.cost.shape import DPShape
from tests.helpers.zero import MICRO, STEPS, TOL, ds_config, full_params, make_engine, train


class TPMLP(torch.nn.Module):
    """Column-parallel then row-parallel linear, as in a transformer MLP."""

    def __init__(self) -> None:
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        torch.manual_seed(0)
        cfg = ModelParallelConfig(
            tensor_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float32
        )
        init = torch.nn.init.xavier_normal_
        super().__init__()
        self.fc1 = ColumnParallelLinear(13, 30, config=cfg, init_method=init, bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(
            30, 7, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(x.unsqueeze(1))  # megatron layers take [sequence, batch, hidden]
        out, _ = self.fc2(torch.tanh(hidden))
        return out.squeeze(1)


def tp_numels() -> tuple[int, ...]:
    return (15 * 13, 15, 7 * 15, 7)


def _tp_variants() -> dict:
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.mpu import MegatronMPU

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    mpu = MegatronMPU()
    dp_rank = mpu.get_data_parallel_rank()
    runs = {"dp_ranks": dist.get_process_group_ranks(mpu.get_data_parallel_group())}
    for name, kind, cfg in (
        ("zero3", "stock", ds_config()),
        ("package", "ours", ds_config({"secondary_level": "auto"})),
        ("node", "ours", ds_config({"secondary_level": "node"})),
    ):
        engine = make_engine(kind, cfg, TPMLP(), mpu=mpu)
        losses, counts = train(engine, range(STEPS), dp_rank, MICRO)
        level = engine.hierarchical_zero.levels.secondary_level if kind == "ours" else None
        runs[name] = {"losses": losses, "counts": counts, "params": full_params(engine), "level": level}
        engine.destroy()
    return runs


@pytest.fixture(scope="module")
def tp_runs(run_ranks):
    return run_ranks(8, _tp_variants, timeout=600)


def test_tp2_matches_stock_zero3_and_uses_strided_dp_groups(tp_runs):
    assert tp_runs[0]["dp_ranks"] == [0, 2, 4, 6]
    for rank_runs in tp_runs:
        ref = rank_runs["zero3"]
        assert rank_runs["package"]["level"] == "package" and rank_runs["node"]["level"] == "node"
        for name in ("package", "node"):
            torch.testing.assert_close(
                torch.tensor(rank_runs[name]["losses"]), torch.tensor(ref["losses"]), **TOL
            )
            for got, want in zip(rank_runs[name]["params"], ref["params"]):
                torch.testing.assert_close(got, want, **TOL)
    # The two TP ranks of one DP rank hold different shards of the same model.
    assert not torch.equal(tp_runs[0]["zero3"]["params"][0], tp_runs[1]["zero3"]["params"][0])


@pytest.mark.parametrize("name", ["zero3", "package", "node"])
def test_tp2_cost_model_bytes_equal_measured(tp_runs, name):
    variant = {"zero3": cm.ZERO3, "package": cm.hierarchical("package"), "node": cm.hierarchical("node")}[
        name
    ]
    model = cm.ShardSpec(param_numels=tp_numels(), weight_bytes=4, grad_bytes=4)
    hops = cm.step_hops(model, DPShape(nodes=2, packages_per_node=2, per_package=1), variant, MICRO)
    for rank_runs in tp_runs:
        step = rank_runs[name]["counts"][-1]
        for phase, kind in (("forward", "gather"), ("backward", "gather"), ("backward", "reduce")):
            measured = step.get(phase, {}).get(kind, {"package": 0, "node": 0, "inter_node": 0})
            assert measured == cm.bytes_per_link(hops, phase, kind), (name, phase, kind)
        if name != "zero3":
            assert step["backward"].get("gather", {}).get("inter_node", 0) == 0
