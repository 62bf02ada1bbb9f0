"""File bytes live in a folder (TIDEPOOL_STORAGE_DIR), one file per id; the ledger keeps metadata only."""
import os
import re
from pathlib import Path

from ..protocol.errors import APIError

_SAFE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
CHUNK = 1 << 20


class Storage:
    def __init__(self, root: str):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not _SAFE_ID.match(file_id):
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id[-2:] / file_id

    def save(self, file_id: str, stream, limit: int, too_large: APIError | None = None) -> int:
        """Copy a stream to storage in chunks; over `limit` bytes, delete it and raise 413 (or `too_large`)."""
        path = self.path(file_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        size = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := stream.read(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise too_large or APIError(413, f"File exceeds the maximum size of {limit} bytes.",
                                                    "file_too_large", "file")
                    out.write(chunk)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def write_lines(self, file_id: str, lines) -> int:
        path = self.path(file_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        with open(path, "wb") as out:
            for line in lines:
                data = line.encode() + b"\n"
                out.write(data)
                size += len(data)
        return size

    def open(self, file_id: str):
        return open(self.path(file_id), "rb")

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
