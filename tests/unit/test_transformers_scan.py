"""The learner's and actor's import of transformers walks its model folders once (runtime/transformers_scan.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from grpo_fleet.runtime import transformers_scan


def test_the_models_packages_init_file_hits_its_folders_cached_walk():
    import transformers.models as models
    from transformers.utils import import_utils

    walk = import_utils.create_import_structure_from_path
    folder = Path(models.__file__).parent
    first = walk(folder)  # what `import transformers` walked (and cached) first
    module = SimpleNamespace(create_import_structure_from_path=walk)
    assert transformers_scan.share_scan(module)
    hits = walk.cache_info().hits
    assert module.create_import_structure_from_path(models.__file__) is first
    assert walk.cache_info().hits == hits + 1
    assert module.create_import_structure_from_path(str(folder / "llama")) == walk(str(folder / "llama"))
    assert not transformers_scan.share_scan(module)  # once only: a second wrapper would add nothing


def test_a_transformers_without_the_cached_walk_is_left_alone():
    module = SimpleNamespace(create_import_structure_from_path=lambda path: {})
    assert not transformers_scan.share_scan(module)
    assert not transformers_scan.share_scan(None)


def test_install_adds_one_finder_that_finds_nothing(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, transformers_scan.MODELS_PACKAGE, raising=False)
    before = len(sys.meta_path)
    transformers_scan.install()
    transformers_scan.install()
    assert len(sys.meta_path) == before + 1
    assert sys.meta_path[0].find_spec("json") is None
