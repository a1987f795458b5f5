"""An actor imports a K-quant GGUF itself, into its own cache, and gets the learner's directory to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_synth import K_TYPES, k_quant_args, spm_vocab, tiny_model, write_model_gguf
from grpo_fleet.actor.admission import ActorRefused, plan_model
from grpo_fleet.models.loading import model_digest
from grpo_fleet.models.zoo import import_source, model_reference
from grpo_fleet.protocol import messages as m


def test_an_actor_imports_a_k_quant_file_to_the_learners_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = spm_vocab()
    args = k_quant_args("gemma3", len(vocab.tokens))
    (tmp_path / "shared").mkdir()
    source = write_model_gguf(tmp_path / "shared" / "k.gguf", tiny_model(args), args, vocab, mixed=K_TYPES).path
    learner_dir = import_source(str(source), tmp_path / "run" / "models")  # as the learner does, into its run dir
    ref = m.ModelRef(path=model_reference(str(source), str(learner_dir)), digest=model_digest(str(learner_dir)))
    monkeypatch.setenv("GRPO_FLEET_MODEL_CACHE", str(tmp_path / "actor-cache"))
    plan = plan_model(ref, [str(tmp_path / "shared")])  # the actor's own import; refused if the digests differ
    assert Path(plan.path).parent == tmp_path / "actor-cache" and Path(plan.path) != learner_dir
    assert model_digest(plan.path) == ref.digest
    # A learner whose copy differs (here: imported from another file) is refused, for good.
    other = ref.model_copy(update={"digest": "0" * 64})
    with pytest.raises(ActorRefused, match="digest mismatch"):
        plan_model(other, [str(tmp_path / "shared")])
