"""Bytes the node loader's ring holds per token and per slot, before and after it carried only token
ids (computed from the ring's layout; the segment file is exactly ``RingLayout.size`` bytes).

    python -m benchmarks.data_loader.ring_bytes

Before (layout version 3): per token int64 tokens, labels and position ids, a float32 loss mask and
int32 document ids, 32 bytes; one slot region per stream of ``mbs x seq`` tokens. After (version 4):
``seq + 1`` ids per sample in uint16 (vocabularies below 65535 ids) or int32, and an 8-byte checksum
per stream; everything else is derived on the rank.
"""

from __future__ import annotations

from megatron_ext.data.ring import RingLayout
from megatron_ext.data.token_ids import TokenCodec

BEFORE_BYTES_PER_TOKEN = 8 + 8 + 8 + 4 + 4  # tokens, labels, position_ids, loss_mask, documents
SHAPES = [  # (what, mbs, seq, streams on a node of 8 ranks)
    ("TP=8 (1 stream), mbs 1 x 8192", 1, 8192, 1),
    ("TP=1 (8 streams), mbs 4 x 8192", 4, 8192, 8),
    ("TP=2 (4 streams), mbs 2 x 4096", 2, 4096, 4),
]
VOCABULARIES = [("GPT-2, 50257 ids", 50_257), ("Llama 3, 128256 ids", 128_256)]
SLOTS = 4


def rows() -> list[tuple[str, str, float, float, int, int]]:
    """(shape, vocabulary, bytes/token before, after, slot bytes before, after) per case."""
    out = []
    for what, mbs, seq, streams in SHAPES:
        for name, vocab in VOCABULARIES:
            codec = TokenCodec.for_vocabulary(vocab, pad=-1)
            after = RingLayout(SLOTS, streams, mbs, seq, 8, codec.token_bytes)
            before_region = -(-mbs * seq * BEFORE_BYTES_PER_TOKEN // 64) * 64
            tokens = mbs * seq * streams
            out.append(
                (
                    what,
                    name,
                    BEFORE_BYTES_PER_TOKEN,
                    streams * after.region_bytes / tokens,
                    streams * before_region,
                    streams * after.region_bytes,
                )
            )
    return out


def main() -> None:
    print("| node layout | vocabulary | bytes/token before | after | slot bytes before | after |")
    print("|---|---|---:|---:|---:|---:|")
    for what, name, before, after, slot_before, slot_after in rows():
        print(f"| {what} | {name} | {before} | {after:.3f} | {slot_before:,} | {slot_after:,} |")


if __name__ == "__main__":
    main()
