"""Content-addressed adapter weights on disk: ``ROOT/<sha256>/`` holds one PEFT adapter.

Identity (`adapter_id`): SHA-256 over a fixed prefix, the adapter's `adapter_config.json`
without the keys that only say where it came from (`VOLATILE_CONFIG_KEYS`), serialized with
sorted keys, then every tensor of `adapter_model.safetensors` in name order as
``name dtype shape`` plus its raw bytes. The safetensors header's own metadata and the file
layout do not count, so the same weights saved twice (or on another machine) get the same id.

Writes never expose half a version: files are copied into ``ROOT/.incoming-*``, flushed to disk,
hashed *as stored*, then the directory is renamed to ``ROOT/<id>`` in one step. Deletion renames
to ``ROOT/.trash-*`` first. Leftover ``.incoming-*`` / ``.trash-*`` directories (a crash) are
never read as versions; `remove_stale` clears them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path

from selfdistill.errors import UserError

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
FILES = (WEIGHTS_FILE, CONFIG_FILE)
VOLATILE_CONFIG_KEYS = frozenset({"base_model_name_or_path", "revision", "inference_mode"})
ID_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def check_adapter_dir(path: Path) -> None:
    """UserError unless `path` is a PEFT adapter directory saved with safetensors."""
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise UserError(
            f"{path}: not a PEFT adapter directory with safetensors weights (missing "
            f"{', '.join(missing)}); save it with save_pretrained(..., safe_serialization=True)"
        )


def adapter_id(path: str | Path) -> str:
    """The content id of the adapter in directory `path` (see the module docstring)."""
    path = Path(path)
    check_adapter_dir(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(b"selfdistill-adapter-v1\n")
    digest.update(json.dumps(kept, sort_keys=True).encode() + b"\n")
    with open(path / WEIGHTS_FILE, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))  # safetensors: u64 LE header length
        header = json.loads(fh.read(header_len))
        start = 8 + header_len
        for name in sorted(k for k in header if k != "__metadata__"):
            info = header[name]
            digest.update(f"{name} {info['dtype']} {info['shape']}\n".encode())
            begin, end = info["data_offsets"]
            fh.seek(start + begin)
            remaining = end - begin
            while remaining:
                chunk = fh.read(min(_CHUNK, remaining))
                if not chunk:
                    raise UserError(f"{path / WEIGHTS_FILE}: truncated safetensors file")
                digest.update(chunk)
                remaining -= len(chunk)
    return digest.hexdigest()


def adapter_bytes(path: Path) -> int:
    """Bytes an adapter directory's stored files take (`FILES`; a README beside them does not
    count, it is not copied)."""
    return sum((path / f).stat().st_size for f in FILES)


def _copy_durably(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, _CHUNK)
        fout.flush()
        os.fsync(fout.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable
    finally:
        os.close(fd)


class WeightStore:
    """The registry's weights directory. Ids are 64 lowercase hex characters."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()

    def path(self, version_id: str) -> Path:
        """Where a version's files live (whether or not they exist)."""
        return self.root / version_id

    def put(self, src: str | Path) -> tuple[str, Path, bool]:
        """Store the adapter in directory `src`; returns (id, path, created). `created` is False
        when identical weights were already stored (nothing is written then)."""
        src = Path(src)
        check_adapter_dir(src)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        try:
            for name in FILES:
                _copy_durably(src / name, tmp / name)
            vid = adapter_id(tmp)  # hash what was stored, not the source (it may change)
            target = self.path(vid)
            if target.is_dir():
                return vid, target, False
            try:
                os.rename(tmp, target)  # atomic; fails if another writer got there first
            except OSError:
                if not target.is_dir():
                    raise
                return vid, target, False
            _fsync_dir(self.root)
            return vid, target, True
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def remove(self, version_id: str) -> int:
        """Delete a version's files; returns the bytes freed (0 if absent)."""
        target = self.path(version_id)
        if not target.is_dir():
            return 0
        size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
        trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=self.root))
        os.rename(target, trash / version_id)  # the id vanishes at once, then files go
        shutil.rmtree(trash, ignore_errors=True)
        return size

    def stored_ids(self) -> list[str]:
        """Ids of the versions present on disk."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if ID_PATTERN.match(p.name))

    def remove_stale(self, older_than_s: float) -> list[str]:
        """Delete ``.incoming-*`` / ``.trash-*`` leftovers older than `older_than_s` seconds
        (a younger one may belong to a write in progress); returns their names."""
        if not self.root.is_dir():
            return []
        cutoff = time.time() - older_than_s
        gone = []
        for p in self.root.iterdir():
            if p.name.startswith((".incoming-", ".trash-")) and p.stat().st_mtime <= cutoff:
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return sorted(gone)
