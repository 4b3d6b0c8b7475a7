"""Read an offline W&B run's records (`run-<id>.wandb`) for tests: wandb 0.31 keeps no Python reader of its
own log. The format is LevelDB's log, as W&B writes it: a 7-byte file header (':W&B', 0xBEE1, version 0),
then 32 KiB blocks of records, each a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle,
4 last) and its bytes, one protobuf `Record` per full or reassembled record."""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run log"
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # the block's tail is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:  # zero padding at the end of a block
            pos += room
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def summary_and_history(path: Path) -> tuple[dict, list[dict]]:
    """The run's last summary values and its history rows, each value as JSON text."""
    summary, history = {}, []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "summary":
            summary |= {item.key or "/".join(item.nested_key): item.value_json for item in record.summary.update}
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return summary, history
