"""Every benchmark entry point under ``benchmarks/``: the steps ``benchmarks.run_all`` runs (standing
benchmarks first, then the one-off studies under ``benchmarks/studies/``), with the arguments of a
full and of a ``--quick`` run, and the reason for each one it never runs itself."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_ARG = "{results}"
"""Stands for the results folder in a step's arguments (``--results`` of run_all)."""


@dataclass(frozen=True)
class Step:
    """One benchmark run and the markdown tables it leaves behind."""

    title: str
    """Heading of the step in the summary."""
    module: str
    """The entry point, ``python -m`` style."""
    args: tuple[str, ...]
    """Arguments after the module; ``{results}`` is the results folder."""
    tables: tuple[str, ...]
    """The markdown files the step writes, relative to the results folder."""
    needs_gpu: bool = False
    study: bool = False
    """A one-off study (benchmarks/studies/), not a standing comparison; listed after those."""
    stdout: str | None = None
    """For a benchmark that only prints its figures: where run_all keeps its output (a markdown file)."""

    def argv(self, results: Path) -> list[str]:
        """The arguments after ``python``."""
        return ["-m", self.module, *(a.replace(RESULTS_ARG, str(results)) for a in self.args)]


# Never a step of their own: each is one rank of another benchmark, started by that benchmark.
RANKS = {
    "benchmarks.studies.cluster.p2p": "one rank of the calibration; started by `benchmarks.studies.cluster.calibrate`",
    "benchmarks.data_loader.node_rank": "one rank of `benchmarks.data_loader.node`, started by it",
    "benchmarks.flash_overlap.rank": "one rank of `benchmarks.flash_overlap.run` and `.overlap`, started by them",
    "benchmarks.flash_overlap.ulysses_rank": "one rank of `benchmarks.flash_overlap.overlap`'s UP part, started by it",
    "benchmarks.studies.flash_overlap.launches_rank": "one rank of `benchmarks.studies.flash_overlap.launches`, started by it",
    "benchmarks.studies.flash_overlap.mds_rank": "one rank of `benchmarks.studies.flash_overlap.mds_layer`, started by it",
    "benchmarks.run_all": "this script",
    "benchmarks.zero.rank": "one rank of `benchmarks.zero.run`, started by it",
    "benchmarks.zero.nic_bytes": "recomputes the per-NIC bytes of A/B results recorded before the A/B counted them "
    "(`python -m benchmarks.zero.nic_bytes FILE.json`), by hand",
}


def left_out(network: str) -> dict[str, str]:
    """Entry points no step of ``network`` runs, with the reason."""
    out = dict(RANKS)
    out["benchmarks.zero.hop_gather"] = (
        "the hop path's own host cost against gloo's flat collectives on 4 local ranks, run by hand beside "
        "an engine change (`python -m benchmarks.zero.hop_gather`): its figures move with the host's load"
    )
    out["benchmarks.zero.loopback"] = (
        "the cost model's host term against 4 local ranks' steps, run by hand on a quiet host "
        "(`python -m benchmarks.zero.loopback`, refused above a load of 3): other work stretches its steps"
    )
    out["benchmarks.flash_overlap.summary"] = (
        "tabulates the preset runs of `benchmarks.flash_overlap.overlap --preset`, each 15 to 30 minutes on the "
        "emulated cluster: by hand, commands in benchmarks/results/flash_overlap.md"
    )
    out["benchmarks.studies.flash_overlap.mds_layer"] = (
        "runs a patched Megatron-DeepSpeed checkout on a dataset of the user's (--tree, --data-path), which "
        "the suite does not ship: by hand, command in benchmarks/results/flash_overlap.md"
    )
    if network != "cluster":
        out["benchmarks.studies.cluster.calibrate"] = (
            "measures the emulated cluster's shaped links: `--network cluster` only (root, ip, tc)"
        )
        out["benchmarks.studies.zero.scale"] = (
            "needs the emulated cluster's per-link latency (16 ranks on 8 nodes): `--network cluster` only (root)"
        )
        out["benchmarks.zero.ab"] = (
            "the probe and the A/B command on the emulated cluster (8 ranks on 4 nodes): `--network cluster` only (root)"
        )
        out["benchmarks.zero.ab_targets"] = (
            "judges the emulated cluster's stand-in A/B runs: `--network cluster` only (root)"
        )
        out["benchmarks.device.validation"] = (
            "reads the stand-in runs of the emulated cluster: `--network cluster` only (root)"
        )
        out["benchmarks.zero.compute_only"] = (
            "the stand-in's ranks on the emulated cluster (8-32 ranks): `--network cluster` only (root)"
        )
        out["benchmarks.studies.zero.regime"] = (
            "sets Frontier's regime against the emulated cluster's A/B runs: `--network cluster` only (root)"
        )
    return out


def _projections(quick: bool) -> list[Step]:
    cases = [(4, 1)] if quick else [(4, 1), (4, 4), (1, 1), (1, 4)]
    return [
        Step(
            f"Frontier projection of hierarchical ZeRO (computed, 20B preset at TP={tp}, accumulation {ga})",
            "benchmarks.studies.zero.project",
            ("--tp", str(tp), "--grad-accum", str(ga), "--name", f"projection_tp{tp}_ga{ga}")
            + ("--out", f"{RESULTS_ARG}/zero"),
            (f"zero/projection_tp{tp}_ga{ga}.md",),
            study=True,
        )
        for tp, ga in cases
    ]


def _activation_memory(quick: bool) -> list[Step]:
    # (tp, hidden, heads, seq, batch, layers): the tiny CPU preset, and the 1.3B preset's layer width.
    cases = (
        [(2, 64, 4, 64, 2, 2)]
        if quick
        else [(2, 64, 4, 64, 2, 2), (4, 64, 4, 64, 2, 2), (2, 2048, 16, 2048, 1, 1)]
    )
    return [
        Step(
            f"Flash-Overlap activation memory per backend (TP={tp}, h={h}, s={s})",
            "benchmarks.studies.flash_overlap.activation_memory",
            ("--tp", str(tp), "--hidden", str(h), "--heads", str(heads), "--seq", str(s), "--batch", str(b))
            + ("--layers", str(layers), "--out", f"{RESULTS_ARG}/flash_overlap"),
            (f"flash_overlap/activation_memory_tp{tp}_h{h}_s{s}.md",),
            study=True,
        )
        for tp, h, heads, s, b, layers in cases
    ]


def steps(network: str, quick: bool) -> list[Step]:
    """Every step of a run on ``network``, in order: the standing benchmarks, each plugin's, then the
    one-off studies (their order kept: the regime study reads the A/B runs' results)."""
    cluster = network == "cluster"
    fo = "cluster400" if cluster else "loopback"  # flash_overlap's file stem at its default 400 Mbit/s
    tps = ("2",) if quick else ("2", "4")
    calibration = Step(
        "Emulated cluster calibration (frontier profile)",
        "benchmarks.studies.cluster.calibrate",
        ("--profile", "frontier", "--json", f"{RESULTS_ARG}/cluster/calibration.json"),
        ("cluster/calibration.md",),
        study=True,
        stdout="cluster/calibration.md",  # the JSON is for the plot; the printed report is the table
    )
    scale = Step(
        "ZeRO variants at scale: 8 nodes of 2 ranks with per-link latency (emulated cluster)",
        "benchmarks.studies.zero.scale",
        ("--quick",) * quick + ("--out", f"{RESULTS_ARG}/zero"),
        (f"zero/scale_8x2{'_quick' if quick else ''}.md",),
        study=True,
    )
    ab = [
        Step(
            f"Hierarchical ZeRO's probe and A/B command, {regime} regime: 4 nodes of 2 ranks (emulated cluster)",
            "benchmarks.zero.ab",
            ("--regime", regime, *("--quick",) * quick, "--out", f"{RESULTS_ARG}/zero"),
            (f"zero/ab_{regime}{'_quick' if quick else ''}.md",),
        )
        for regime in ("frontier", "latency")
    ]
    device = [
        Step(
            f"Hierarchical ZeRO's A/B, {regime} regime, compute on the MI250X stand-in: 4 nodes of 2 MI250Xs (emulated cluster)",
            "benchmarks.zero.ab",
            ("--device", "mi250x", "--regime", regime, *("--quick",) * quick, "--out", f"{RESULTS_ARG}/zero"),
            (f"zero/ab_{regime}_mi250x{'_quick' if quick else ''}.md",),
        )
        for regime in ("frontier", "latency")
    ]
    device.append(
        Step(
            "The MI250X stand-in's compute-only step at 8, 16 and 32 ranks (emulated cluster)",
            "benchmarks.zero.compute_only",
            ("--device", "mi250x", "--nodes", *(("2", "4") if quick else ("2", "4", "8")))
            + ("--quick",) * quick
            + ("--out", f"{RESULTS_ARG}/zero"),
            (f"zero/compute_only_mi250x{'_quick' if quick else ''}.md",),
        )
    )
    suffix = "_quick" if quick else ""
    device.append(
        Step(
            "Hierarchical ZeRO's targets, from the stand-in A/B above",
            "benchmarks.zero.ab_targets",
            (
                f"{RESULTS_ARG}/zero/ab_frontier_mi250x{suffix}.json",
                "--out",
                f"{RESULTS_ARG}/zero/targets{suffix}.md",
            ),
            (f"zero/targets{suffix}.md",),
        )
    )
    device.append(
        Step(
            "Validation of the device-faithful cluster, from the results above",
            "benchmarks.device.validation",
            ("--results", RESULTS_ARG),
            ("emulated_validation.md",),
        )
    )
    regime = Step(
        "The regimes' dimensionless numbers: Frontier's (computed) against both A/B runs'",
        "benchmarks.studies.zero.regime",
        (f"{RESULTS_ARG}/zero/ab_frontier{suffix}.json", f"{RESULTS_ARG}/zero/ab_latency{suffix}.json")
        + ("--out", f"{RESULTS_ARG}/zero/regime{suffix}.md"),
        (f"zero/regime{suffix}.md",),
        study=True,
    )
    ordered = [
        *[calibration] * cluster,
        *_projections(quick),
        Step(
            f"Hierarchical ZeRO vs ZeRO-3 and ZeRO++ hpZ ({network})",
            "benchmarks.zero.run",
            ("--network", network, "--launches", "1" if quick else "3", "--out", f"{RESULTS_ARG}/zero")
            + (("--micro", "1") if quick else ()),
            (f"zero/{network}.md",),
        ),
        Step(
            "ZeRO-3 build and first-step memory per rank: ZeRO-3, hpZ, ours built partitioned and whole (4 CPU ranks)",
            "benchmarks.studies.zero.memory",
            ("--repeats", "2" if quick else "5", "--out", f"{RESULTS_ARG}/zero"),
            ("zero/build_memory.md",),
            study=True,
        ),
        *[scale] * cluster,
        *ab * cluster,
        *device * cluster,
        *[regime] * cluster,
        Step(
            f"Flash-Overlap MLP and layer, forward + backward, vs megatron-core and 4-chunk slicing ({network})",
            "benchmarks.flash_overlap.run",
            ("--network", network, "--tp", *tps, "--out", f"{RESULTS_ARG}/flash_overlap"),
            tuple(f"flash_overlap/{fo}_tp{tp}.md" for tp in tps),
        ),
        Step(
            f"Flash-Overlap and UP attention vs TE's split and DistributedAttention, same transport ({network})",
            "benchmarks.flash_overlap.overlap",
            ("--network", network, *(("--quick",) if quick else ()), "--out", f"{RESULTS_ARG}/flash_overlap"),
            (f"flash_overlap/overlap_{fo}{'_quick' if quick else ''}.md",),
        ),
        Step(
            "Flash-Overlap kernel launches per layer against megatron-core and DistributedAttention (counted)",
            "benchmarks.studies.flash_overlap.launches",
            ("--out", f"{RESULTS_ARG}/flash_overlap"),
            ("flash_overlap/launches.md",),
            study=True,
        ),
        *_activation_memory(quick),
        Step(
            "Node loader vs Megatron's TP-rank-0 DataLoader path at 8 ranks, TP=1/2/4/8, cold reads from a slowed filesystem; mask memory",
            "benchmarks.data_loader.node",
            ("--quick",) * quick + ("--out", f"{RESULTS_ARG}/data_loader"),
            ("data_loader/node.md",),
        ),
        Step(
            "Set-up time and memory of the producer's index streams",
            "benchmarks.data_loader.sampler_setup",
            ("--samples", "1000000") if quick else ("--list-streams", "8"),
            ("data_loader/sampler_setup.md",),
            stdout="data_loader/sampler_setup.md",
        ),
        Step(
            "Main job on one GPU with and without the plugins",
            "benchmarks.gpu.main_job",
            ("--launches", "1") * quick + ("--out", f"{RESULTS_ARG}/gpu"),
            ("gpu/main_job.md",),
            needs_gpu=True,
        ),
        Step(
            "The main job's GPU record predicted by the H100 stand-in on this host (computed)",
            "benchmarks.device.main_job",
            ("--out", f"{RESULTS_ARG}/gpu"),
            ("gpu/standin_main_job.md",),
        ),
        Step(
            "Node loader's GPU copy path vs Megatron's, one GPU",
            "benchmarks.gpu.loader_cuda",
            ("--steps", "20") * quick + ("--out", f"{RESULTS_ARG}/gpu"),
            ("gpu/loader_cuda.md",),
            needs_gpu=True,
        ),
        Step(
            "GEMM efficiency kept when the overlap schedules slice a GEMM, one GPU",
            "benchmarks.gpu.sliced_gemm",
            ("--reps", "3") * quick + ("--out", f"{RESULTS_ARG}/gpu"),
            ("gpu/sliced_gemm.md",),
            needs_gpu=True,
        ),
    ]
    return [s for s in ordered if not s.study] + [s for s in ordered if s.study]


def entry_points() -> list[str]:
    """Every module under ``benchmarks/`` that runs as a script, ``python -m`` style."""
    main = re.compile(r"^if __name__ == .__main__.:", re.MULTILINE)
    return sorted(
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in (REPO / "benchmarks").rglob("*.py")
        if main.search(path.read_text())
    )
