"""The files of a checkpoint: rank files written atomically, the manifest, the exchanges."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gossamer import ops
from gossamer.errors import GossamerError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "RECORD",
    "CheckpointError",
    "exchange",
    "from_rank0",
    "is_complete",
    "read_rank_file",
    "read_saved",
    "shared_manifest",
    "write_manifest",
    "write_rank_file",
]

#: name of the manifest file in a checkpoint directory
MANIFEST = "manifest.json"
FORMAT = "gossamer.checkpoint"
FORMAT_VERSION = 1
#: what a rank reports of its file: step (-1: none), size, SHA-256 as four int64
RECORD = 6


class CheckpointError(GossamerError, RuntimeError):
    """A checkpoint is incomplete or corrupt, or another rank failed to save or load."""


def file_name(rank: int) -> str:
    """The name of ``rank``'s file in a checkpoint directory."""
    return f"rank{rank}.pt"


def write_rank_file(directory: Path, rank: int, payload: dict) -> list[int]:
    """Write ``payload`` as ``rank``'s file; return its record (step, size, SHA-256)."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    write_atomically(directory / file_name(rank), data)
    step = payload["step"]
    digest = hashlib.sha256(data).digest()
    return [-1 if step is None else step, len(data), *struct.unpack("<4q", digest)]


def write_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file and rename it: ``target`` is whole or absent."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def exchange(
    rank: int, size: int, error: Exception | None, record: list[int], what: str
) -> list[list[int]]:
    """Every rank's ``record``; every rank raises if any rank failed (a hang otherwise)."""
    if size == 1:
        if error is not None:
            raise error
        return [record]
    mine = torch.tensor([[0 if error is None else 1, *record]], dtype=torch.int64)
    rows = ops.allgather(mine).tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise CheckpointError(f"checkpoint {what} failed on rank(s) {failed}; see their errors")
    return [row[1:] for row in rows]


def _version() -> str:
    try:
        return importlib.metadata.version("gossamer")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def write_manifest(directory: Path, records: dict[int, list[int]], world_size: int) -> None:
    """Write the manifest of the rank files that ``records`` (rank: record) describe.

    ``world_size`` is the job's; after a death (an elastic save) ``records`` holds the
    survivors only, and the manifest's ``ranks`` says which ranks the checkpoint has.
    """
    files = [
        {
            "rank": rank,
            "file": file_name(rank),
            "bytes": nbytes,
            "sha256": struct.pack("<4q", *digest).hex(),
            "step": None if step < 0 else step,
        }
        for rank, (step, nbytes, *digest) in sorted(records.items())
    ]
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gossamer_version": _version(),
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world_size": world_size,
        "ranks": [entry["rank"] for entry in files],
        "step": files[0]["step"],
        "files": files,
    }
    write_atomically(directory / MANIFEST, json.dumps(manifest, indent=2).encode())


def is_complete(manifest: dict) -> bool:
    """Whether the checkpoint holds every rank of its job (not only the survivors)."""
    return manifest["ranks"] == list(range(manifest["world_size"]))


def read_manifest(directory: Path) -> dict:
    """The manifest in ``directory``, checked for its format."""
    if not directory.is_dir():
        raise FileNotFoundError(f"path {str(directory)!r} is not a directory")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"path {str(directory)!r} has no {MANIFEST}: the save was interrupted before every "
            "rank had written its file, or this is not a gossamer checkpoint"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({err}): corrupted?") from err
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("format_version") != FORMAT_VERSION
    ):
        raise CheckpointError(
            f"{manifest_path} is not a gossamer checkpoint manifest of format version "
            f"{FORMAT_VERSION}"
        )
    return manifest


def shared_manifest(rank: int, size: int, directory: Path | None) -> dict:
    """Rank 0's manifest on every rank (the other ranks' machines may not have the file)."""

    def read() -> bytes:
        if directory is None:
            raise CheckpointError("rank 0 was given no valid path")
        return json.dumps(read_manifest(directory)).encode()

    if size == 1 and directory is None:
        raise CheckpointError("no valid path to read a manifest from")
    return json.loads(from_rank0(rank, size, read, "read the manifest"))


def from_rank0(rank: int, size: int, produce: Callable[[], bytes], what: str) -> bytes:
    """The bytes that ``produce()`` returns on rank 0, on every rank.

    Collective. When ``produce`` raises on rank 0, rank 0 raises its error and every other
    rank a :class:`CheckpointError` that quotes it, rather than waiting.
    """
    if size == 1:
        return produce()
    data, failure = b"", None
    if rank == 0:
        try:
            data = b"\x00" + produce()
        except Exception as err:
            failure = err
            data = b"\x01" + f"{type(err).__name__}: {err}".encode()
    length = ops.broadcast(torch.tensor([len(data)], dtype=torch.int64), root=0)
    received = torch.zeros(int(length[0]), dtype=torch.uint8)
    if rank == 0:
        received = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    data = ops.broadcast(received, root=0).numpy().tobytes()
    if failure is not None:
        raise failure
    if data[:1] == b"\x01":
        raise CheckpointError(f"rank 0 could not {what}: {data[1:].decode()}")
    return data[1:]


def read_rank_file(directory: Path, manifest: dict, rank: int, size: int) -> dict:
    """This rank's payload, once its file is found to match ``manifest``."""
    saved = manifest["world_size"]
    if not is_complete(manifest):
        raise ValueError(
            f"path {str(directory)!r} holds the state of ranks {manifest['ranks']} of a job "
            f"of {saved} (the survivors of a death): resume it with resize=True"
        )
    if saved != size:
        raise ValueError(
            f"path {str(directory)!r} holds a checkpoint of world size {saved}; this job has "
            f"world size {size}: resume with {saved} ranks, or pass resize=True"
        )
    return read_saved(directory, manifest, rank)


def read_saved(directory: Path, manifest: dict, rank: int) -> dict:
    """Saved rank ``rank``'s payload, once its file is found to match ``manifest``."""
    entry = next(e for e in manifest["files"] if e["rank"] == rank)
    path = directory / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (listed in {MANIFEST})")
    data = path.read_bytes()
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"{path} does not match {MANIFEST} (size or SHA-256): it was "
            "changed, or overwritten by a save that did not finish"
        )
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if payload.get("rank") != rank:
        raise CheckpointError(f"{entry['file']} holds rank {payload.get('rank')}'s state")
    return payload
