"""Cost model arithmetic: the ZeRO++ paper's cross-node volumes, hop volumes, the planner's choice."""

from __future__ import annotations

import pytest

from deepspeed_ext.config import HierarchicalZeroConfig
from deepspeed_ext.zero import cost_model as cm
from deepspeed_ext.zero.planner import choose_secondary_level, describe

FRONTIER_384 = cm.DPShape(nodes=48, packages_per_node=4, per_package=2)
PSI = 384 * 1_000_000  # parameters, a multiple of the DP size: no padding
MODEL = cm.ModelSpec(param_numels=(PSI,), weight_bytes=2, grad_bytes=2)
M = 2 * PSI  # bytes of the 16-bit model


def inter_node(variant: cm.Variant, micro: int = 1) -> int:
    return cm.bytes_per_link(cm.step_hops(MODEL, FRONTIER_384, variant, micro))["inter_node"]


def test_zeropp_paper_cross_node_volumes():
    frac = (384 - 1) / 384
    assert inter_node(cm.ZERO3) == pytest.approx(3 * M * frac)  # ZeRO++: 3M for ZeRO-3
    assert inter_node(cm.hpz(8, "node")) == pytest.approx(2 * M * frac)  # hpZ removes the backward gather
    assert inter_node(cm.zeropp_paper(8, "node")) == pytest.approx(0.75 * M * frac)  # 0.5M qwZ + 0.25M qgZ


def test_hierarchical_hops_send_one_eighth_across_nodes():
    hops = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("package"))
    across = (48 - 1) / 48 * M / 8
    assert cm.bytes_per_link(hops, "forward", "gather") == {"package": M // 2, "node": 3 * M // 8,
                                                            "inter_node": pytest.approx(across)}
    assert cm.bytes_per_link(hops, "backward", "gather") == {"package": M // 2, "node": 0, "inter_node": 0}
    assert cm.bytes_per_link(hops, "backward", "reduce") == {"package": M // 2, "node": 3 * M // 8,
                                                             "inter_node": pytest.approx(across)}
    node = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("node"))
    assert cm.bytes_per_link(node, "backward", "gather") == {"package": M // 2, "node": 3 * M // 8, "inter_node": 0}


def test_micro_batches_reuse_the_secondary_copy():
    hops = cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("package"), micro_batches=4)
    forward = cm.bytes_per_link(hops, "forward", "gather")
    assert forward["inter_node"] == inter_node(cm.hierarchical("package"), 1) - cm.bytes_per_link(
        cm.step_hops(MODEL, FRONTIER_384, cm.hierarchical("package")), "backward", "reduce")["inter_node"]
    assert forward["package"] == M // 2 + 3 * (M // 2)  # one primary gather, three secondary


def test_padding_follows_zero3():
    model = cm.ModelSpec(param_numels=(13, 8, 1), weight_bytes=4, grad_bytes=4)
    assert model.padded(8) == 16 + 8 + 8


def test_time_model_shares_nics_and_clamps_overlap():
    links = cm.Links(ranks_per_nic=2)
    assert links.rank_bandwidth("inter_node") == 12.5e9
    assert links.rank_bandwidth("package") == 200e9
    hops = [cm.Hop("backward", "reduce", "inter_node", 4, 12_500_000_000, 1, 1)]
    assert cm.comm_time(hops, links) == pytest.approx(1.0 + 3 * 10e-6)
    assert cm.step_time(1.0, 3.0, overlap=1.0) == pytest.approx(3.0)
    assert cm.step_time(1.0, 3.0, overlap=0.0) == pytest.approx(4.0)


def test_planner_picks_fastest_level_within_budget():
    links = cm.Links()
    big = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=1e3)
    assert choose_secondary_level(big, FRONTIER_384, MODEL, links).level == "package"
    middle = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=M / 8 / 1e9)
    choice = choose_secondary_level(middle, FRONTIER_384, MODEL, links)
    assert choice.level == "node" and choice.extra_bytes == {"package": M // 2, "node": M // 8}
    tiny = HierarchicalZeroConfig(enabled=True, secondary_memory_budget_gb=1e-3)
    assert choose_secondary_level(tiny, FRONTIER_384, MODEL, links).level == "global"
    one_node = cm.DPShape(nodes=1, packages_per_node=4, per_package=2)
    forced = HierarchicalZeroConfig(enabled=True, secondary_level="node")
    assert choose_secondary_level(forced, one_node, MODEL, links).level == "global"
    alone = cm.DPShape(nodes=1, packages_per_node=1, per_package=1)  # one rank: nothing to place
    assert choose_secondary_level(big, alone, MODEL, links).level == "global"
    package_is_group = cm.DPShape(nodes=1, packages_per_node=1, per_package=2)
    assert choose_secondary_level(HierarchicalZeroConfig(enabled=True, secondary_level="package"), package_is_group,
                                  MODEL, links).level == "global"
    assert "secondary level package" in describe(choose_secondary_level(big, FRONTIER_384, MODEL, links), FRONTIER_384)
