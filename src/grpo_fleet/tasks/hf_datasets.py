"""One split of a Hugging Face dataset: a hub id, a local data file or directory, or a `save_to_disk` directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from grpo_fleet.tasks.examples import BUILTIN_PREFIX, resolve_task_path

Loader = Callable[..., Any]

# Local data files and the `datasets` builder that reads each.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# A single data file is one split, and `datasets` names it this.
FILE_SPLIT = "train"


class SplitError(ValueError):
    """A split the dataset does not have (the message lists the ones it has)."""


def local_path(source: str) -> Optional[Path]:
    """The local file or directory `source` names, or None for a hub id.

    Anything that exists locally, or looks like a path (a data-file suffix, or
    starting with '/', '.', '~' or 'builtin:'), is local; a missing one is an
    error here rather than a confusing hub lookup.
    """
    path = resolve_task_path(source)
    if path.exists():
        return path
    looks_local = source.startswith(("/", ".", "~", BUILTIN_PREFIX)) or Path(source).suffix in FILE_BUILDERS
    if looks_local:
        raise FileNotFoundError(f"task.dataset = {source!r}: no such file or directory")
    return None


def load_split(
    source: str, split: str, *, config: Optional[str] = None,
    load_dataset: Optional[Loader] = None, load_from_disk: Optional[Loader] = None,
) -> Any:
    """The `datasets.Dataset` for one split; ValueError for a split that is missing or has no rows.

    `load_dataset` and `load_from_disk` default to the `datasets` functions;
    tests pass their own to see what a hub id would be loaded with.
    """
    if load_dataset is None or load_from_disk is None:
        import datasets  # imported on use: pyarrow and pandas take a second or two

        load_dataset = load_dataset or datasets.load_dataset
        load_from_disk = load_from_disk or datasets.load_from_disk
    path = local_path(source)
    try:
        if path is None:
            dataset = load_dataset(source, name=config, split=split)
        elif is_saved_to_disk(path):
            dataset = _pick_split(load_from_disk(str(path)), split, source)
        elif path.is_file():
            dataset = load_dataset(_builder(path), data_files=str(path), split=_file_split(split, source))
        else:
            dataset = load_dataset(str(path), name=config, split=split)
    except SplitError:
        raise
    except ValueError as error:
        # `datasets` errors ("Unknown split", 'Instruction "train" corresponds to no data!') do not say which dataset.
        raise ValueError(f"{source} split {split!r}: {error}") from error
    if len(dataset) == 0:
        raise ValueError(f"{source} split {split!r} has no rows")
    return dataset



def is_saved_to_disk(path: Path) -> bool:
    """Whether `path` is a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _pick_split(loaded: Any, split: str, source: str) -> Any:
    if not hasattr(loaded, "keys"):  # one Dataset saved alone: a single split
        loaded = {FILE_SPLIT: loaded}
    if split not in loaded:
        raise SplitError(f"{source} has no split {split!r}; its splits are {', '.join(loaded.keys())}")
    return loaded[split]


def _builder(path: Path) -> str:
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"{path}: unknown data file type; use one of {', '.join(FILE_BUILDERS)}")
    return builder


def _file_split(split: str, source: str) -> str:
    if split != FILE_SPLIT:
        raise SplitError(
            f"{source} is one file, so its only split is {FILE_SPLIT!r}, not {split!r}: leave task.eval_split unset "
            "to hold out its last num_eval rows, or point task.dataset at a directory of train/test files"
        )
    return split
