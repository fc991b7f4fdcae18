"""Training rows written to files: JSON Lines, or Parquet through pyarrow (the `parquet`
extra), streamed.

`write_rows(rows, path_or_file, kind)` takes any iterable of rows (`iter_token_samples`,
`iter_tree_samples` or lists of them) and writes them as they come: a Parquet file gets a row
group as soon as the rows gathered reach half the largest row seen so far (a large row is a
row group of its own, small ones are gathered), so what is held while writing stays under
about 1.5 rows' worth (the rows gathered and the one being made), whatever the number of
rows. A numpy row's arrays are written without a copy.

Each Parquet column has a fixed type (`path_schema()`, `tree_schema()`): token ids int64,
masks int8, logprobs and rewards float64, positions and node indexes int32, `paths` a list
of structs; pandas, DuckDB and Hugging Face `datasets` read it. JSON Lines are `json.dumps`
of each row (numpy arrays as lists).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from ..errors import InvalidArgumentError
from ..files.atomic import replace_file
from .jsonstream import writer_for

__all__ = ["FORMATS", "KINDS", "path_schema", "tree_schema", "write_rows"]

#: Row kinds and the output formats, by file suffix.
KINDS = ("path", "tree")
FORMATS = {".parquet": "parquet", ".jsonl": "jsonl"}


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - the extra is installed in tests
        raise InvalidArgumentError(
            "writing Parquet needs pyarrow: pip install 'rollout_store[parquet]'"
        ) from None
    return pa, pq


def path_schema() -> Any:
    """The Parquet schema of `token_samples` rows."""
    pa, _ = _pyarrow()
    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("rollout_logprobs", pa.list_(pa.float64())),
            ("position_ids", pa.list_(pa.int32())),
            ("leaf_id", pa.string()),
            ("reward", pa.float64()),
            ("stop_reason", pa.string()),
            ("root_id", pa.string()),
            ("node_ids", pa.list_(pa.string())),
            ("n_trainable", pa.int64()),
            ("discarded", pa.bool_()),
            ("group", pa.string()),
        ]
    )


def tree_schema() -> Any:
    """The Parquet schema of `tree_samples` rows."""
    pa, _ = _pyarrow()
    path = pa.struct(
        [
            ("leaf_node", pa.int32()),
            ("leaf_id", pa.string()),
            ("reward", pa.float64()),
            ("stop_reason", pa.string()),
            ("n_trainable", pa.int64()),
            ("length", pa.int64()),
            ("graph", pa.int32()),
        ]
    )
    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("rollout_logprobs", pa.list_(pa.float64())),
            ("position_ids", pa.list_(pa.int32())),
            ("token_node", pa.list_(pa.int32())),
            ("token_owner_path", pa.list_(pa.int32())),
            ("node_ids", pa.list_(pa.string())),
            ("node_parent", pa.list_(pa.int32())),
            ("node_enter", pa.list_(pa.int32())),
            ("node_exit", pa.list_(pa.int32())),
            ("node_offset", pa.list_(pa.int64())),
            ("node_length", pa.list_(pa.int64())),
            ("paths", pa.list_(path)),
            ("n_tokens", pa.int64()),
            ("n_trainable", pa.int64()),
            ("group", pa.string()),
            ("n_graphs", pa.int32()),
        ]
    )


def _batch(row: dict[str, Any], schema: Any) -> Any:
    """One row as a record batch of the schema (fields it lacks are refused)."""
    pa, _ = _pyarrow()
    arrays = []
    for f in schema:
        if f.name not in row:
            raise InvalidArgumentError(f"a row without its {f.name!r} field cannot be written")
        value = row[f.name]
        if f.name in ("reward",) and value is not None:
            value = float(value)
        elif f.name == "paths":
            value = [
                {**p, "reward": None if p["reward"] is None else float(p["reward"])} for p in value
            ]
        try:
            arrays.append(_column(pa, value, f.type))
        except (pa.ArrowInvalid, OverflowError, TypeError, UnicodeEncodeError) as exc:
            raise InvalidArgumentError(
                f"row field {f.name!r} cannot be written as {f.type}: {exc}"
            ) from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _column(pa: Any, value: Any, type_: Any) -> Any:
    """A one-row column; a list column of a numpy array is built over the array's memory
    (no Python objects, no copy when its dtype is the column's)."""
    if pa.types.is_list(type_) and hasattr(value, "dtype") and value.dtype != object:
        values = pa.array(value, type=type_.value_type)
        return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values)
    return pa.array([value], type=type_)


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _format_of(target: str | os.PathLike[str] | IO[Any], format: str | None) -> str:
    if format is not None:
        if format not in FORMATS.values():
            raise InvalidArgumentError(
                f"unknown row format {format!r}: use one of {', '.join(FORMATS.values())}"
            )
        return format
    if not isinstance(target, str | os.PathLike):
        return "jsonl"  # an open file
    name = os.fspath(target)
    for suffix, found in FORMATS.items():
        if name.endswith(suffix):
            return found
    raise InvalidArgumentError(
        f"{name}: name the output file with one of {', '.join(FORMATS)} (Parquet or JSON Lines)"
    )


def write_rows(
    rows: Iterable[dict[str, Any]],
    target: str | os.PathLike[str] | IO[Any],
    kind: str,
    *,
    format: str | None = None,
) -> int:
    """Write `rows` (of `kind` "path" or "tree") to `target` as they come; returns how many.

    `format`: "parquet" or "jsonl"; by default from the file name's suffix (an open file is
    written as JSON Lines unless `format="parquet"`, which needs a binary file). Parquet is
    written a row group at a time.

    A path is written through a temporary file (mode 0600, see `atomic`) renamed over it
    only once every row is written: an error while the rows are made or written (a damaged
    input, a full disk) leaves a file already at the path as it was. An open file is the
    caller's: what was written to it before an error stays there.
    """
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown row kind {kind!r}: use one of {', '.join(KINDS)}")
    chosen = _format_of(target, format)
    schema = None if chosen == "jsonl" else path_schema() if kind == "path" else tree_schema()
    if not isinstance(target, str | os.PathLike):
        return _write(rows, target, schema)
    written = [0]

    def write(fp: IO[bytes]) -> None:
        written[0] = _write(rows, fp, schema)

    replace_file(Path(os.fspath(target)), write)
    return written[0]


def _write(rows: Iterable[dict[str, Any]], fp: IO[Any], schema: Any) -> int:
    """`rows` written to the open file `fp`: JSON Lines, or Parquet of `schema` if one."""
    if schema is None:
        return _write_jsonl(rows, fp)
    pa, _ = _pyarrow()
    return _write_parquet(rows, pa.PythonFile(_Sink(fp), mode="w"), schema)


class _Sink:
    """An open binary file as a write-only stream that knows its position (what pyarrow asks
    of a stream it writes Parquet to: a pipe cannot `tell`)."""

    def __init__(self, fp: IO[bytes]) -> None:
        self.fp = fp
        self.position = 0
        self.closed = False

    def write(self, data: Any) -> int:
        self.fp.write(bytes(data))
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        self.fp.flush()

    def close(self) -> None:
        self.flush()
        self.closed = True

    def writable(self) -> bool:
        return True


def _write_jsonl(rows: Iterable[dict[str, Any]], fp: IO[Any]) -> int:
    write = writer_for(fp)
    n = 0
    for row in rows:
        write(json.dumps({k: _plain(v) for k, v in row.items()}))
        write("\n")
        n += 1
    return n


def _write_parquet(rows: Iterable[dict[str, Any]], target: Any, schema: Any) -> int:
    pa, pq = _pyarrow()
    n = 0
    gathered: list[Any] = []
    size = largest = 0
    with pq.ParquetWriter(target, schema, use_dictionary=False) as writer:
        for row in rows:
            gathered.append(_batch(row, schema))
            del row  # (no name keeps a written row alive while the next one is made)
            nbytes = gathered[-1].nbytes
            largest = max(largest, nbytes)
            size += nbytes
            n += 1
            if 2 * size >= largest:  # written before the next row is made
                writer.write_table(pa.Table.from_batches(gathered, schema=schema))
                gathered, size = [], 0
        if gathered:
            writer.write_table(pa.Table.from_batches(gathered, schema=schema))
    return n
