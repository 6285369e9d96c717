"""Checks of a dataset file that need no dataset library: the file type, UTF-8, at least one row,
and the first JSON line that does not parse (each error names the file and the line)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from hsx.errors import HsxError

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _position(path: Path, data: bytes, offset: int) -> str:
    """``file:line, column`` (both 1-based) of byte ``offset`` of ``data``, the whole file's bytes."""
    line = data.count(b"\n", 0, offset) + 1
    column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return f"{path}:{line}, column {column}"


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """Refuse a text file that is not UTF-8, naming the line (the json and csv readers assume UTF-8
    and would fail later, mid-run, on the first row holding such bytes)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            pending = len(decoder.getstate()[0])  # bytes of a sequence cut by the previous block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                data = path.read_bytes()
                at = done - pending + e.start
                at = max(0, min(at, len(data) - 1))
                raise HsxError(f"{_position(path, data, at)}: byte 0x{data[at]:02x} is not valid UTF-8; hsx reads "
                               "UTF-8 text (re-encode the file, e.g. iconv -f latin1 -t utf-8)") from None
            if not block:
                return
            done += len(block)


def check_has_rows(path: Path, builder: str) -> None:
    """Refuse a file with no rows: nothing but whitespace, (csv) nothing after the header, (parquet) a
    footer that counts none."""
    if builder == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError):
            return  # not a Parquet file: the library's own error says so
        if rows == 0:
            raise HsxError(f"{path}: no rows (the Parquet file holds none)")
        return
    lines = 0
    with open(path, "rb") as f:
        for line in f:  # stops at the first row: cheap for any file that has one
            lines += bool(line.strip())
            if lines > (builder == "csv"):
                return
    what = "only a header line" if lines else "the file is empty"
    raise HsxError(f"{path}: no rows ({what}); expected {'JSON objects, one per line' if builder == 'json' else 'a header line, then rows'}")


def check_json(path: Path) -> None:
    """Name the first line of a JSON-lines file (or the place in a JSON document) that does not parse."""
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)
        return  # one JSON document: the file is valid JSON; the library failed for another reason
    except ValueError:
        pass
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError as e:
            reason = getattr(e, "msg", str(e))
            raise HsxError(f"{path}:{lineno}, column {getattr(e, 'colno', '?')}: not valid JSON ({reason}); "
                           "expected one JSON object per line") from None
