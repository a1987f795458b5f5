"""`ollama:` and `lmstudio:` names, resolved on folders built to the apps' documented layouts: Ollama's manifests
and content-addressed blobs ($OLLAMA_MODELS), LM Studio's models/PUBLISHER/NAME/*.gguf under the home folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from grpo_fleet.models.app_stores import MODEL_LAYER, AppModelError, app_gguf, is_app_path, modelfile
from grpo_fleet.models.zoo import gguf_file, is_gguf_source

GGUF_BYTES = b"GGUF" + bytes(range(60))  # what the store holds; resolving never parses it


def _ollama_store(root: Path, repo: tuple[str, ...], tag: str, blob: bytes = GGUF_BYTES,
                  digest: str | None = None) -> Path:
    """A model pulled into an Ollama store at `root`: its blob, a config blob, and the manifest naming both."""
    digest = digest or hashlib.sha256(blob).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(blob)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64,
                           "size": 2},
                "layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64,
                            "size": 10},
                           {"mediaType": MODEL_LAYER, "digest": f"sha256:{digest}", "size": len(blob)}]}
    path = root.joinpath("manifests", *repo, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return root / "blobs" / f"sha256-{digest}"


@pytest.fixture
def ollama_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ollama-models"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


def test_an_ollama_name_resolves_to_its_model_blob(ollama_root: Path) -> None:
    blob = _ollama_store(ollama_root, ("registry.ollama.ai", "library", "smollm2"), "135m")
    assert app_gguf("ollama:smollm2:135m") == blob
    assert gguf_file("ollama:smollm2:135m") == blob and is_gguf_source("ollama:smollm2:135m")


def test_the_tag_defaults_to_latest_and_a_namespace_or_host_is_kept(ollama_root: Path) -> None:
    latest = _ollama_store(ollama_root, ("registry.ollama.ai", "library", "qwen3"), "latest", blob=b"GGUF latest")
    user = _ollama_store(ollama_root, ("registry.ollama.ai", "someone", "tuned"), "v1", blob=b"GGUF user")
    hosted = _ollama_store(ollama_root, ("hf.co", "org", "model"), "Q8_0", blob=b"GGUF hosted")
    assert app_gguf("ollama:qwen3") == latest
    assert app_gguf("ollama:someone/tuned:v1") == user
    assert app_gguf("ollama:hf.co/org/model:Q8_0") == hosted


def test_a_blob_that_is_not_its_digest_is_refused(ollama_root: Path) -> None:
    _ollama_store(ollama_root, ("registry.ollama.ai", "library", "bad"), "latest", digest="a" * 64)
    with pytest.raises(AppModelError, match="does not have the digest its manifest names"):
        app_gguf("ollama:bad")


def test_a_model_not_pulled_is_refused_with_where_it_looked(ollama_root: Path) -> None:
    with pytest.raises(AppModelError, match=r"no manifest at .*library/absent/latest .*ollama pull absent"):
        app_gguf("ollama:absent")


@pytest.mark.parametrize("name", ["", "../x", "a//b", "a/b/c/d", "x:"])
def test_a_malformed_ollama_name_is_refused(name: str, ollama_root: Path) -> None:
    with pytest.raises(AppModelError, match="not an Ollama model name"):
        app_gguf(f"ollama:{name}")


def test_without_the_env_var_the_store_is_in_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    blob = _ollama_store(tmp_path / ".ollama" / "models", ("registry.ollama.ai", "library", "m"), "latest")
    assert app_gguf("ollama:m") == blob


def _lmstudio(root: Path, name: str, files: list[str]) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for file in files:
        (folder / file).write_bytes(GGUF_BYTES)
    return folder


def test_an_lmstudio_name_resolves_to_the_one_gguf_in_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = _lmstudio(tmp_path / ".lmstudio" / "models", "infra-ai/ocelot-v1",
                       ["ocelot-v1-instruct-q4_0.gguf", "mmproj-ocelot-f16.gguf", "README.md"])
    assert app_gguf("lmstudio:infra-ai/ocelot-v1") == folder / "ocelot-v1-instruct-q4_0.gguf"
    assert is_app_path("lmstudio:infra-ai/ocelot-v1") and not is_app_path("zoo:smollm2-135m-instruct")


def test_lmstudios_older_folder_is_read_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = _lmstudio(tmp_path / ".cache" / "lm-studio" / "models", "old/model", ["model.Q8_0.gguf"])
    assert gguf_file("lmstudio:old/model") == folder / "model.Q8_0.gguf"


def test_several_ggufs_are_refused_in_one_line_listing_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    _lmstudio(tmp_path / ".lmstudio" / "models", "pub/many", ["m-Q4_K_M.gguf", "m-Q8_0.gguf"])
    with pytest.raises(AppModelError, match=r"2 GGUF files in .* \(m-Q4_K_M.gguf, m-Q8_0.gguf\)") as caught:
        app_gguf("lmstudio:pub/many")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["justone", "a/b/c", "../b", "a/"])
def test_a_malformed_lmstudio_name_is_refused(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(AppModelError, match="not PUBLISHER/NAME"):
        app_gguf(f"lmstudio:{name}")


def test_a_modelfile_without_chatml_leaves_the_template_to_the_gguf() -> None:
    text = modelfile("m.gguf", "{{ bos_token }}<start_of_turn>user", ["<end_of_turn>", "<eos>"], 0.9, 1.0)
    assert "TEMPLATE" not in text.replace("# No TEMPLATE", "")
    assert 'PARAMETER stop "<end_of_turn>"\nPARAMETER stop "<eos>"\n' in text and "PARAMETER temperature 0.9\n" in text


def _tiny_gguf(path: Path) -> bytes:
    from gguf_synth import byte_level_vocab, tiny_args, tiny_model, write_model_gguf

    vocab = byte_level_vocab()
    args = tiny_args("qwen2", len(vocab.tokens))
    return write_model_gguf(path, tiny_model(args), args, vocab).path.read_bytes()


def test_an_ollama_model_trains_like_a_gguf_file_on_the_learner_and_on_actors(
        tmp_path: Path, ollama_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_fleet.actor import admission
    from grpo_fleet.models.zoo import import_source, model_reference

    blob = _ollama_store(ollama_root, ("registry.ollama.ai", "library", "tiny"), "latest", blob=_tiny_gguf(tmp_path / "t.gguf"))
    imported = import_source("ollama:tiny", tmp_path / "learner-cache")
    assert json.loads((imported / "gguf_source.json").read_text())["file"] == blob.name
    # The learner tells actors the name, and each finds the model in its own Ollama store, no --model-dir needed.
    assert model_reference("ollama:tiny", str(imported)) == "ollama:tiny"
    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(tmp_path / "actor-cache"))
    on_actor = Path(admission.local_model_path("ollama:tiny", []))
    assert on_actor.parent == tmp_path / "actor-cache" and (on_actor / "model.safetensors").is_file()
    with pytest.raises(admission.ActorRefused, match=r"cannot import the learner's model 'ollama:absent'.*ollama pull absent"):
        admission.local_model_path("ollama:absent", [])
