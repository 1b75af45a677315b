"""Cost of a micro-batch's attention mask at s=8192: ours against megatron-core's GPTDataset.

    .venv/bin/python -m benchmarks.attention_mask [--seq 8192] [--mbs 1 4] [--repeats 7]

Megatron's path (``--create-attention-mask-in-dataloader``, its default): the dataset builds a
[1, s, s] mask per sample (``_get_ltor_masks_and_position_ids``, float, then compared to bool) and
the DataLoader stacks them. Ours: one [mbs, 1, s, s] bool mask built from the document ids where the
tokens live (here the CPU; on a GPU it is a few device kernels). Both with documents of 500-4000
tokens, causal only and with ``reset_attention_mask``. Wall clock of each build, measured in this
process one after the other, repeated; writes ``benchmarks/results/attention_mask.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_ext.data.documents import attention_mask, document_ids

EOD = 256
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _tokens(mbs: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(0, EOD, (mbs, seq), generator=gen)
    for row in tokens:
        pos = int(torch.randint(500, 4000, (1,), generator=gen))
        while pos < seq:
            row[pos] = EOD
            pos += int(torch.randint(500, 4000, (1,), generator=gen))
    return tokens


def _upstream(tokens: torch.Tensor, reset: bool) -> torch.Tensor:
    return torch.stack(
        [_get_ltor_masks_and_position_ids(row, EOD, False, reset, False, True)[0] for row in tokens]
    )


def _ours(tokens: torch.Tensor, reset: bool) -> torch.Tensor:
    mbs, seq = tokens.shape
    return attention_mask(mbs, seq, tokens.device, document_ids(tokens, EOD) if reset else None)


def _time_ms(fn, tokens: torch.Tensor, reset: bool, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tokens, reset)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mbs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=OUT, help="folder of attention_mask.json / .md")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the training thread's share; the dataset's build is single-threaded too
    gen = torch.Generator().manual_seed(0)
    rows = []
    load_before = os.getloadavg()
    for mbs in args.mbs:
        tokens = _tokens(mbs, args.seq, gen)
        for reset in (False, True):
            assert torch.equal(_ours(tokens, reset), _upstream(tokens, reset))  # same mask, or no figure
            for name, fn in (("megatron dataset", _upstream), ("ours", _ours)):
                t = _time_ms(fn, tokens, reset, args.repeats)
                rows.append(
                    dict(
                        mbs=mbs,
                        mask="reset" if reset else "causal",
                        path=name,
                        min=min(t),
                        median=statistics.median(t),
                        max=max(t),
                    )
                )
    result = dict(
        seq=args.seq, repeats=args.repeats, threads=1, load_average=[load_before, os.getloadavg()], rows=rows
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_mask.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"s={args.seq}, {args.repeats} repetitions, 1 thread, load average before/after "
        f"{load_before[0]:.1f} / {os.getloadavg()[0]:.1f}",
        "",
        "| mbs | mask | path | min ms | median ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['mbs']} | {r['mask']} | {r['path']} | {r['min']:.1f} | {r['median']:.1f} | {r['max']:.1f} |"
        for r in rows
    ]
    with open(os.path.join(args.out, "attention_mask.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
