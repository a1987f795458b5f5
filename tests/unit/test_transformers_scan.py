"""transformers' walk of its model folders comes from a cache file after the first process (runtime/transformers_scan.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from grpo_fleet.runtime import transformers_scan


def _real_walk() -> Any:
    """transformers' own walk, under any wrapper that a CLI run in this process put around it."""
    from transformers.utils import import_utils

    walk = import_utils.create_import_structure_from_path
    return walk if hasattr(walk, "cache_info") else walk.__wrapped__


def _models_folder() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


class Counting:
    def __init__(self, walk: Any) -> None:
        self.walk, self.paths = walk, []

    def __call__(self, path: Any) -> Any:
        self.paths.append(str(path))
        return self.walk(path)


def test_the_models_folder_is_walked_once_then_read_from_its_cache_file(tmp_path):
    folder, walk = _models_folder(), Counting(_real_walk())
    cached = transformers_scan.cached_walk(walk, folder, tmp_path)
    first = cached(folder)
    assert walk.paths == [str(folder)] and len(list(tmp_path.glob("models-*.json"))) == 1
    assert cached(str(folder / "__init__.py")) is first  # the package's second walk, keyed by its folder
    assert walk.paths == [str(folder)]

    in_another_process = transformers_scan.cached_walk(walk, folder, tmp_path)
    again = in_another_process(folder)
    assert walk.paths == [str(folder)]  # read, not walked
    assert again == walk.walk(folder) and len(again) > 400  # the real structure, frozenset keys and all
    llama = next(iter(again["llama"]))
    assert isinstance(llama, frozenset) and isinstance(again["llama"][llama], dict)
    assert in_another_process(str(folder / "llama")) == walk.walk(str(folder / "llama"))
    assert walk.paths[-1] == str(folder / "llama")  # a folder below is the walk's own business


def test_a_round_trip_keeps_sets_frozensets_and_keys_apart():
    structure = {"a": {frozenset(): {"m": {"X", "Y"}}, frozenset({"torch"}): {"n": {"Z"}}}, "b": {}}
    back = transformers_scan.decode(json.loads(json.dumps(transformers_scan.encode(structure))))
    assert back == structure
    assert type(back["a"][frozenset()]["m"]) is set and all(type(k) is frozenset for k in back["a"])
    with pytest.raises(TypeError):
        transformers_scan.encode({"a": [1]})


def _tree(root: Path) -> Path:
    (root / "models" / "llama").mkdir(parents=True)
    (root / "models" / "llama" / "configuration_llama.py").write_text("__all__ = ['LlamaConfig']\n")
    (root / "models" / "__init__.py").write_text("")
    return root / "models"


def test_any_change_the_walk_would_see_names_another_cache_file(tmp_path):
    folder = _tree(tmp_path)
    digest = transformers_scan.tree_digest(str(folder))
    (folder / "llama" / "README.md").write_text("not read by the walk")
    (folder / "__pycache__").mkdir()
    assert transformers_scan.tree_digest(str(folder)) == digest
    config = folder / "llama" / "configuration_llama.py"
    os.utime(config, ns=(1, 1))
    touched = transformers_scan.tree_digest(str(folder))
    assert touched != digest
    (folder / "gemma").mkdir()
    assert transformers_scan.tree_digest(str(folder)) not in (digest, touched)


@pytest.mark.parametrize("content", ["{", "[]", '{"dict": [[1, "x"]]}', '{"set": [1]}', '{"dict": [["a", 2]]}', "\u00ff"])
def test_a_corrupt_or_foreign_cache_file_is_walked_over_and_replaced(tmp_path, content):
    folder, walk = _tree(tmp_path / "site"), Counting(lambda path: {"llama": {frozenset(): {"c": {"C"}}}})
    path = tmp_path / "cache" / f"models-{transformers_scan.tree_digest(str(folder))}.json"
    path.parent.mkdir()
    path.write_text(content)
    assert transformers_scan.cached_walk(walk, folder, path.parent)(folder) == {"llama": {frozenset(): {"c": {"C"}}}}
    assert len(walk.paths) == 1
    assert transformers_scan.read_cached(path) == {"llama": {frozenset(): {"c": {"C"}}}}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left beside it


def test_a_cache_folder_that_cannot_be_written_costs_only_the_walk(tmp_path):
    folder, blocker = _tree(tmp_path / "site"), tmp_path / "a-file"
    blocker.write_text("")
    walk = Counting(lambda path: {"x": {}})
    cached = transformers_scan.cached_walk(walk, folder, blocker / "cache")
    assert cached(folder) == {"x": {}} and cached(folder) == {"x": {}}
    assert len(walk.paths) == 1  # the process still walks once


def test_patch_walk_takes_only_the_cached_walk_it_expects(tmp_path):
    folder = _tree(tmp_path / "transformers")
    (tmp_path / "transformers" / "utils").mkdir()
    module_file = tmp_path / "transformers" / "utils" / "import_utils.py"
    module = SimpleNamespace(create_import_structure_from_path=_real_walk(), __file__=str(module_file))
    assert transformers_scan.patch_walk(module, tmp_path / "cache")
    assert module.create_import_structure_from_path(folder)["llama"] == {frozenset(): {"configuration_llama": {"LlamaConfig"}}}
    assert not transformers_scan.patch_walk(module, tmp_path / "cache")  # once only
    assert not transformers_scan.patch_walk(SimpleNamespace(create_import_structure_from_path=lambda p: {}), tmp_path)
    assert not transformers_scan.patch_walk(None, tmp_path)


def test_the_finder_hands_transformers_import_utils_to_the_patching_loader(tmp_path, monkeypatch):
    import transformers.utils

    monkeypatch.setenv(transformers_scan.CACHE_ENV, str(tmp_path))
    finder = transformers_scan._BeforeImportUtils()
    assert finder.find_spec("json") is None
    spec = finder.find_spec(transformers_scan.IMPORT_UTILS, transformers.utils.__path__)
    assert spec is not None and finder.find_spec(transformers_scan.IMPORT_UTILS, transformers.utils.__path__) is None
    module = importlib.util.module_from_spec(spec)  # a second copy of the module, run apart from the imported one
    spec.loader.exec_module(module)
    patched = module.create_import_structure_from_path
    assert not hasattr(patched, "cache_info") and patched.__wrapped__ is not None
    assert patched(_models_folder()) == _real_walk()(_models_folder())
    assert len(list(tmp_path.glob("models-*.json"))) == 1


def test_install_adds_one_finder(monkeypatch):
    others = [f for f in sys.meta_path if not isinstance(f, transformers_scan._BeforeImportUtils)]  # conftest's
    monkeypatch.setattr(sys, "meta_path", others)
    monkeypatch.delitem(sys.modules, transformers_scan.IMPORT_UTILS, raising=False)
    before = len(sys.meta_path)
    transformers_scan.install()
    transformers_scan.install()
    assert len(sys.meta_path) == before + 1 and isinstance(sys.meta_path[0], transformers_scan._BeforeImportUtils)
