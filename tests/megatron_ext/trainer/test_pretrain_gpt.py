"""The main job as a user runs it: loss falls at TP=2 x DP=2, resume continues the same curve,
and bad input stops it with one clear line.

The first run is launched by torchrun, as a user launches it; the others fork their ranks from a
warm interpreter with torchrun's variables (``multirank.warm``: a run's 4 ranks would otherwise
spend most of it importing torch, DeepSpeed and megatron-core), and the resumed run must continue
torchrun's curve."""

import json
import subprocess
import sys

import pytest

from multirank import free_port
from tests.helpers.main_job import SCRIPT, SMALL, job_env


def _warm_run(main_job_warm, tmp_path, nproc, *flags, timeout=240):
    log = tmp_path / f"run-{len(list(tmp_path.glob('run-*.log')))}.log"
    argv = [SCRIPT, *SMALL, "--data-cache-path", str(tmp_path / "data"), *flags]
    codes = main_job_warm.launch(argv, tmp_path, log, 1, nproc, free_port(), timeout)
    out = log.read_text(errors="replace")
    assert codes == [0] * nproc, f"exit codes {codes}:\n{out[-5000:]}"
    return out


def _torchrun(tmp_path, nproc, *flags, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--standalone",  # a rendezvous port the OS picks: no other job's port collides
        SCRIPT,
        *SMALL,
        "--data-cache-path",
        str(tmp_path / "data"),
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _losses(path):
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(path))}


def _zero3_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"torch_adam": True}}}
        )
    )
    return str(path)


@pytest.mark.slow
def test_loss_falls_and_a_resumed_run_continues_the_same_curve(main_job_warm, tmp_path):
    ds = _zero3_config(tmp_path)
    common = ["--tensor-model-parallel-size", "2", "--train-iters", "6", "--deepspeed-config", ds]
    ckpt = tmp_path / "ckpt"
    out = _torchrun(
        tmp_path,
        4,
        *common,
        "--save",
        str(ckpt),
        "--save-interval",
        "3",
        "--log-json",
        str(tmp_path / "full.jsonl"),
    )
    full = _losses(tmp_path / "full.jsonl")
    # Megatron's iteration line (its format: test_iteration_log.py), once, from rank 0
    last = [line for line in out.splitlines() if " iteration        6/       6 |" in line]
    assert len(last) == 1, out[-3000:]
    for field in ("| lm loss: ", "| grad norm: ", "| tokens/s: ", "| peak RSS (GB): "):
        assert field in last[0], last[0]
    record = json.loads((tmp_path / "full.jsonl").read_text().splitlines()[-1])
    assert record["ms_per_iter"] > 0 and record["memory_gb"] > 0 and record["consumed_samples"] == 6 * 4
    assert full[6] < full[1] - 0.5, full

    # Resume from the checkpoint of iteration 3 (the run saved at 3 and 6; DeepSpeed loads the tag in `latest`).
    (ckpt / "latest").write_text("iter_0000003")
    _warm_run(
        main_job_warm,
        tmp_path,
        4,
        *common,
        "--load",
        str(ckpt),
        "--log-json",
        str(tmp_path / "resumed.jsonl"),
    )
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for it in range(4, 7):
        assert resumed[it] == pytest.approx(full[it], rel=1e-5), it


@pytest.mark.slow
def test_hierarchical_zero_builds_partitioned_and_prints_stock_zero3s_losses(main_job_warm, tmp_path):
    """One node of two packages: the hops run package, then node. Nothing is built whole, and the
    model is the one stock's whole build makes: the losses are stock ZeRO-3's, to the last bit."""
    losses = {}
    for name, extra in (("stock", {}), ("ours", {"hierarchical_zero": {"enabled": True}})):
        ds = tmp_path / f"{name}.json"
        ds.write_text(
            json.dumps(
                {
                    "zero_optimization": {"stage": 3},
                    "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
                    "topology": {"ranks_per_node": 4, "ranks_per_package": 2},
                    **extra,
                }
            )
        )
        log = tmp_path / f"{name}.jsonl"
        out = _warm_run(
            main_job_warm,
            tmp_path,
            4,
            "--train-iters",
            "3",
            "--deepspeed-config",
            str(ds),
            "--log-json",
            str(log),
        )
        losses[name] = _losses(log)
    assert "hierarchical_zero: the model is built partitioned over 4 ranks (secondary level package)" in out
    assert losses["ours"] == losses["stock"] and sorted(losses["stock"]) == [1, 2, 3]


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--data-path", "/nonexistent/corpus"], {}, "error: /nonexistent/corpus.idx does not exist"),
        (
            ["--tensor-model-parallel-size", "2"],
            {"WORLD_SIZE": "3", "RANK": "0"},
            "error: --tensor-model-parallel-size 2 does not divide the world size 3",
        ),
        (["--shm-data-loader-slots", "0"], {}, "error: invalid plugin config: shm_data_loader.slots=0"),
        (
            ["--shm-data-loader", "--shm-data-loader-dir", "/nonexistent"],
            {},
            "error: shm_data_loader.shm_dir='/nonexistent' is not a directory: point it at a tmpfs",
        ),
        (
            ["--shm-data-loader", "--micro-batch-size", "100000000"],
            {},
            "error: the shared-memory data loader needs",
        ),
    ],
)
def test_bad_input_exits_with_one_clear_line(pretrain_main, monkeypatch, capsys, flags, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert pretrain_main(*flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_config_typo_stops_the_script_with_one_line(main_job_warm, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"shm_data_loader": {"enabeld": True}}))
    log = tmp_path / "typo.log"
    assert main_job_warm.launch(
        [SCRIPT, "--deepspeed-config", str(cfg)], tmp_path, log, 1, 1, free_port(), 120
    ) == [2]
    out = log.read_text()
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("error: invalid plugin config: unknown key 'shm_data_loader.enabeld'")
    )
    assert "Traceback" not in out


def _corpus_of_ids(prefix: str, largest: int) -> None:
    """Documents of random ids below ``largest``, each ended by ``largest`` (a NullTokenizer's EOD)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(200):
        doc = rng.integers(0, largest, int(rng.integers(20, 120)))
        builder.add_item(torch.from_numpy(np.append(doc, largest)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_data_with_ids_beyond_the_vocabulary_stops_naming_both_numbers(pretrain_main, capsys, tmp_path):
    _corpus_of_ids(str(tmp_path / "ids"), 999)
    assert pretrain_main("--data-path", str(tmp_path / "ids")) == 2
    err = capsys.readouterr().err
    assert "holds token id 999 but the vocabulary has 257 ids" in err and "--vocab-size" in err, err
    assert "Traceback" not in err


def test_a_corpus_of_a_larger_vocabulary_trains_with_its_vocab_size(pretrain_main, tmp_path):
    _corpus_of_ids(str(tmp_path / "ids"), 999)
    log = tmp_path / "log.jsonl"
    assert (
        pretrain_main(
            "--data-path",
            str(tmp_path / "ids"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "999",
            "--train-iters",
            "2",
            "--log-json",
            str(log),
        )
        == 0
    )
    first = json.loads(log.read_text().splitlines()[0])["loss"]
    assert first > 6.5, first  # ~ln(1024): the output layer spans the padded 1000-id vocabulary


def test_tensorboard_without_its_package_is_one_clear_line(pretrain_main, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where tensorboard is not installed
    assert pretrain_main("--tensorboard-dir", str(tmp_path / "tb")) == 2
    err = capsys.readouterr().err
    assert "error: --tensorboard-dir needs the tensorboard package: pip install tensorboard" in err
    assert "Traceback" not in err
