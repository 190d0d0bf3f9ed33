"""Rows from a Hugging Face dataset: `hf:NAME_OR_PATH[:SPLIT]` in any data.* setting.

NAME_OR_PATH is a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, a
folder of data files (parquet, JSON, CSV) `datasets.load_dataset` understands, or a hub id
(only where a network or a local hub cache exists: nothing is downloaded otherwise). SPLIT
defaults to 'train'. `columns` renames dataset columns to the fields regen reads (for
example {"prompt": "question"}).
"""

from __future__ import annotations

from pathlib import Path

from regen.errors import DataError


def parse_spec(spec: str) -> tuple[str, str]:
    """'hf:org/name:test' -> ('org/name', 'test'); no split -> 'train'."""
    body = spec.removeprefix("hf:")
    name, sep, split = body.rpartition(":")
    if not sep or "/" in split or not split:  # no split given (a ':' inside a path is not one)
        return body, "train"
    return name, split


def read_hf(spec: str, required: tuple[str, ...], where: str, columns: dict[str, str] | None = None) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{where}: '{spec}' needs the datasets package: pip install 'regen[hf]'") from None
    name, split = parse_spec(spec)
    if not name:
        raise DataError(f"{where}: '{spec}' names no dataset (expected hf:NAME_OR_PATH[:SPLIT])")
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise DataError(f"{where}: dataset folder '{name}' not found")  # a hub id is 'org/name'
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(path))  # written by save_to_disk
        else:
            ds = datasets.load_dataset(str(path) if path.exists() else name)
    except FileNotFoundError:
        raise DataError(f"{where}: dataset '{name}' not found (not a local folder, and not in the hub cache)") from None
    except Exception as e:  # datasets raises many types (ConnectionError, DatasetNotFoundError...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{where}: cannot load dataset '{name}': {first}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{where}: dataset '{name}' has no split '{split}' (it has: {', '.join(ds)})")
        ds = ds[split]
    rename = columns or {}
    wanted = {field: rename.get(field, field) for field in required}
    missing = [f"'{col}'" + (f" (for {field})" if col != field else "") for field, col in wanted.items()
               if col not in ds.column_names]
    if missing:
        raise DataError(f"{where}: dataset '{name}' split '{split}' has no column {', '.join(missing)} "
                        f"(columns: {', '.join(ds.column_names)}; data.columns renames them)")
    rows = []
    back = {col: field for field, col in rename.items()}
    for n, raw in enumerate(ds):
        row = {back.get(k, k): v for k, v in raw.items()}
        for field in required:
            if not isinstance(row.get(field), str):
                kind = type(row.get(field)).__name__
                raise DataError(f"{where}: dataset '{name}' row {n}: '{wanted[field]}' is a {kind}, not a string "
                                "(conversational datasets need their messages rendered to text first)")
        rows.append(row)
    if not rows:
        raise DataError(f"{where}: dataset '{name}' split '{split}' holds no rows")
    return rows
