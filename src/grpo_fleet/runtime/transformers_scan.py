"""transformers walks its model folders once per process, not twice.

`import transformers` walks the ~450 folders under `transformers/models` to build its lazy import table. Importing
the `transformers.models` package, which `AutoTokenizer` does (mlx-lm's tokenizer loading), walks them all again:
the walk's cache (transformers 5.x, `create_import_structure_from_path`) is keyed by how the path is spelled, a
folder `Path` the first time and the package's `__init__.py` as a string the second, and at 128 entries it no longer
holds the folders inside. Every learner and actor process paid the second walk, about 0.3 of the 1.3 CPU seconds
that importing mlx-lm costs here (measured with `-X importtime`).

`install()` puts a finder in front of Python's import system that, the moment `transformers.models` is first
imported, makes the second walk a cache hit: a file path is looked up as its folder, which is what the walk itself
does with it. Where transformers' internals are not what this expects, it changes nothing. Upstream's work on this
import's time is huggingface/transformers#44246; once a release walks the folders once, this can go.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from pathlib import Path
from typing import Any, Optional, Sequence

MODELS_PACKAGE = "transformers.models"


def share_scan(import_utils: Any) -> bool:
    """Key `import_utils`'s cached folder walk by folder, so that a package's `__init__.py` hits its folder's entry."""
    walk = getattr(import_utils, "create_import_structure_from_path", None)
    if walk is None or not hasattr(walk, "cache_info"):  # not the cached walk, or already keyed by folder
        return False

    def keyed_by_folder(module_path: Any) -> Any:
        if os.path.isfile(module_path):  # the walk reads a file as its folder; so does its cache, now
            module_path = Path(os.path.dirname(module_path))
        return walk(module_path)

    import_utils.create_import_structure_from_path = keyed_by_folder
    return True


class _BeforeTransformersModels(MetaPathFinder):
    """Finds nothing: it only notices the first import of `transformers.models`, when the first walk is done."""

    def __init__(self) -> None:
        self.done = False  # not removed from sys.meta_path: the import system is iterating over that list

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None) -> None:
        if fullname == MODELS_PACKAGE and not self.done:
            self.done = True
            share_scan(sys.modules.get("transformers.utils.import_utils"))
        return None


def install() -> None:
    """Once a process, before transformers is imported (the CLI's first step)."""
    if MODELS_PACKAGE in sys.modules or any(isinstance(f, _BeforeTransformersModels) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTransformersModels())
