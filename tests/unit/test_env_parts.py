"""The environment's parts: tool calls (malformed ones too), the template difference, skyrl-gym's gsm8k
multi-turn environment run unchanged, reasoning-gym tasks, and the episode fields on the wire (issue 28)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from grpo_fleet.config import TaskConfig
from grpo_fleet.envs.hosting import EnvCall, EnvCalls, InlineEnvs
from grpo_fleet.envs.template import ObservationEncoder, TemplateError
from grpo_fleet.envs.tools import ToolCall, ToolCallError, ToolEnv, parse_tool_call
from grpo_fleet.models.loading import load_policy
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import build_task
from grpo_fleet.tasks.env_module import EnvLoadError, EnvSetup, split_env_spec


class Lookup(ToolEnv):
    tools = ("capital",)

    def capital(self, country: str) -> str:
        if country == "Atlantis":
            raise KeyError(country)
        return {"Kenya": "Nairobi"}.get(country, "unknown")

    def answer(self, text: str) -> float:
        return 1.0 if "Nairobi" in text else 0.0


@pytest.mark.parametrize("text, problem", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>["capital"]</tool_call>', '"name"'),
    ('<tool_call>{"name": "capital", "arguments": "Kenya"}</tool_call>', '"arguments" must be an object'),
    ('<tool_call>{"name": "capital", "arguments": {"country": "Kenya"}}', "no closing"),
    # These escaped as RecursionError and ValueError (issue 39, item 9): the episode failed instead.
    ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", "nested too deeply"),
    ('<tool_call>{"name": "capital", "arguments": {"n": ' + "9" * 5_000 + "}}</tool_call>", "cannot be read"),
])
def test_a_malformed_tool_call_is_refused_with_what_was_wrong(text: str, problem: str) -> None:
    with pytest.raises(ToolCallError, match=problem):
        parse_tool_call(text)
    out = Lookup({}, {}).step(text)  # the model is told, the episode goes on
    assert out["done"] is False and out["reward"] == 0.0
    told = out["observations"][0]["content"]
    assert told.startswith("<tool_response>\nerror:") and problem in told


def test_finding_the_tool_call_is_linear_in_the_turn() -> None:
    text = "<tool_call>" * 4096  # a lazy regex took about 1 s on this
    # This thread's CPU time, not the wall clock: a loaded machine (pytest-xdist beside real-model tests) once
    # descheduled the worker for a second here, which a wall-clock bound read as quadratic work.
    started = time.thread_time()
    with pytest.raises(ToolCallError, match="no closing"):
        parse_tool_call(text)
    assert time.thread_time() - started < 0.1


def test_a_tool_call_runs_the_method_and_its_result_is_the_next_observation() -> None:
    text = 'Let me look. <tool_call>{"name": "capital", "arguments": {"country": "Kenya"}}</tool_call>'
    assert parse_tool_call(text) == ToolCall("capital", {"country": "Kenya"})
    env = Lookup({}, {})
    assert env.step(text)["observations"] == [{"role": "user", "content": "<tool_response>\nNairobi\n</tool_response>"}]
    final = env.step("The capital of Kenya is Nairobi.")
    assert final["done"] is True and final["reward"] == 1.0 and env.turns == 2


@pytest.mark.parametrize("call, said", [
    ('{"name": "weather", "arguments": {}}', "no tool 'weather'; the tools are capital"),
    ('{"name": "capital", "arguments": {"city": "Kenya"}}', "capital does not take those arguments"),
    ('{"name": "capital", "arguments": {"country": "Atlantis"}}', "capital failed: KeyError"),
])
def test_a_call_that_cannot_run_is_answered_not_raised(call: str, said: str) -> None:
    out = Lookup({}, {}).step(f"<tool_call>{call}</tool_call>")
    assert said in out["observations"][0]["content"] and out["done"] is False


def test_a_turn_without_a_tool_call_is_the_final_answer() -> None:
    assert parse_tool_call("Nairobi.") is None
    assert Lookup({}, {}).step("It is Mombasa.") == {"observations": [], "reward": 0.0, "done": True, "metadata": {}}


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir: Path) -> Any:
    return load_policy(str(tiny_chat_model_dir)).tokenizer


def test_the_observation_chunk_is_the_templates_difference(tokenizer: Any) -> None:
    encoder = ObservationEncoder(tokenizer, tokenizer.eos_token_ids)
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    observation = [{"role": "user", "content": "Try again."}]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The model sampled <|im_end|>: the chunk starts after it, with the template's newline.
    expected = "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    assert encoder.chunk_text(conversation, im_end, observation) == expected
    # Cut off before its stop token: the chunk closes the turn first.
    assert encoder.chunk_text(conversation, 5, observation).startswith("<|im_end|>\n<|im_start|>user\n")
    assert encoder.chunk(conversation, im_end, observation) == tokenizer.encode(
        encoder.chunk_text(conversation, im_end, observation), add_special_tokens=False)


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_chat_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model_dir))
    # Renders only the last two messages: adding an observation changes what came before.
    tokenizer.chat_template = ("{% for message in messages[-2:] %}<|im_start|>{{ message['role'] }}\n"
                               "{{ message['content'] }}<|im_end|>\n{% endfor %}")
    encoder = ObservationEncoder(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    with pytest.raises(TemplateError, match="renders earlier turns differently"):
        encoder.chunk_text([{"role": "user", "content": "hi"}], 0, [{"role": "user", "content": "again"}])


def test_skyrl_gyms_gsm8k_multi_turn_environment_runs_unchanged() -> None:
    pytest.importorskip("skyrl_gym")
    module, class_name = split_env_spec("skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv")
    from grpo_fleet.envs.protocol import env_extras

    envs = InlineEnvs(EnvSetup(module=module, class_name=class_name, max_turns=3))
    extras = env_extras({"question": "Tom has 3 apples and buys 15 more."}, "18", 3)
    prompt = [{"role": "user", "content": "Tom has 3 apples and buys 15 more. How many? End with '#### N'."}]
    steps = [EnvCall(1, "init", (extras, prompt)), EnvCall(1, "step", "I think #### 17"), EnvCall(1, "step", "#### 18"),
             EnvCall(1, "close")]
    init, wrong, right, close = envs.run_envs(EnvCalls(steps))
    assert init.conversation == prompt and close.failure is None
    assert wrong.step is not None and not wrong.step.done and wrong.step.reward == pytest.approx(0.2 / 3)
    assert "#### ANSWER" in wrong.step.observations[0]["content"]
    assert right.step is not None and right.step.done and right.step.reward == 1.0


def test_an_environment_that_breaks_the_interface_fails_its_episode_only(tmp_path: Path) -> None:
    path = tmp_path / "bad_env.py"
    path.write_text("class Bad:\n    def __init__(self, c, e): pass\n    def init(self, p): return p, {}\n"
                    "    def step(self, a): return {'observations': 'text', 'reward': 1.0, 'done': False}\n")
    envs = InlineEnvs(EnvSetup(module=str(path), class_name="Bad"))
    init, step, again = envs.run_envs(EnvCalls([EnvCall(3, "init", ({}, [{"role": "user", "content": "x"}])),
                                                EnvCall(3, "step", "a"), EnvCall(3, "step", "b")]))
    assert init.failure is None and step.failure == "interface" and "list of chat messages" in step.detail
    assert again.failure == "lost"  # the failed episode's environment is gone
    with pytest.raises(EnvLoadError, match="no class 'Missing'"):
        InlineEnvs(EnvSetup(module=str(path), class_name="Missing"))


def test_reasoning_gym_tasks_need_no_download_and_score_with_their_own_scorer() -> None:
    pytest.importorskip("reasoning_gym")
    cfg = TaskConfig(name="reasoning_gym", dataset="chain_sum:3,basic_arithmetic", num_train=12, num_eval=4, seed=5,
                     generator_options={"chain_sum": {"min_terms": 2, "max_terms": 2}}, rewards=["reasoning_gym"])
    task, again = build_task(cfg), build_task(cfg)
    assert [e.prompt for e in task.train] == [e.prompt for e in again.train] and len(task.eval) == 4
    assert [e.prompt for e in task.eval] != [e.prompt for e in task.train[:4]]  # eval is drawn with its own seed
    sources = {e.columns["metadata"]["source_dataset"] for e in task.train}
    assert sources == {"chain_sum", "basic_arithmetic"}
    example = task.train[0]
    assert task.score(f"Thinking... <answer>{example.answer}</answer>", example) == 1.0
    assert task.score("<answer>definitely not it</answer>", example) == 0.0
    with pytest.raises(ValueError, match="no generator 'not_a_generator'"):
        build_task(cfg.model_copy(update={"dataset": "not_a_generator"}))
    with pytest.raises(ValueError, match="task 'reasoning_gym' needs task.dataset"):
        TaskConfig(name="reasoning_gym")


def test_task_env_needs_the_chat_template() -> None:
    with pytest.raises(ValueError, match="task.env needs task.chat_template"):
        TaskConfig(env="grpo_fleet.envs.capital_quiz:CapitalQuiz")


# ---------------------------------------------------------------------- the wire


def _completion(tokens: list[int], logprobs: list[float], **episode: Any) -> m.Completion:
    return m.Completion(tokens=m.Tensor.from_numpy(np.array(tokens, np.int32)),
                        logprobs=m.Tensor.from_numpy(np.array(logprobs, np.float32)), reward=0.5,
                        finish_reason="stop", **episode)


def _mask(values: list[int], dtype: Any = np.uint8) -> m.Tensor:
    return m.Tensor.from_numpy(np.array(values, dtype))


def test_an_episode_on_the_wire_holds_together() -> None:
    episode = _completion([5, 6, 7, 8, 9], [-0.5, -0.1, 0.0, 0.0, -0.2], mask=_mask([1, 1, 0, 0, 1]), turns=[0, 4],
                          end="done")
    assert episode.turns == [0, 4]
    _completion([4, 5], [0.0, -1.0], mask=_mask([0, 1]), turns=[1], end="budget")  # init's appended messages first


@pytest.mark.parametrize("episode, problem", [
    ({"mask": _mask([1, 1, 0, 1])}, "mask, turns and end together"),
    ({"mask": _mask([1, 1, 0]), "turns": [0], "end": "done"}, "uint8 tensor of the tokens' shape"),
    ({"mask": _mask([1, 1, 0, 1], np.int32), "turns": [0, 3], "end": "done"}, "uint8 tensor"),
    ({"mask": _mask([1, 2, 0, 1]), "turns": [0, 3], "end": "done"}, "values must be 0 or 1"),
    ({"mask": _mask([1, 1, 1, 0]), "turns": [0], "end": "done"}, "ending on a sampled token"),
    ({"mask": _mask([1, 1, 0, 1]), "turns": [0], "end": "done"}, "are not where the mask's sampled runs start"),
    ({"mask": _mask([1, 1, 0, 1]), "turns": [0, 2], "end": "done"}, "are not where the mask's sampled runs start"),
    ({"mask": _mask([1, 0, 0, 1]), "turns": [0, 3], "end": "done"}, "environment tokens (mask 0) must carry logprob 0"),
    ({"mask": _mask([1, 1, 0, 1]), "turns": [0, 3], "end": "tired"}, "end"),
])
def test_a_bad_episode_is_refused_at_the_door(episode: dict, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        _completion([5, 6, 7, 8], [-0.5, -0.1, 0.0, -0.2], **episode)


def test_a_run_without_an_environment_needs_a_reward() -> None:
    with pytest.raises(ValidationError, match="needs at least one reward"):
        m.Welcome.model_validate({
            "run_id": "r", "actor_id": "a", "model": {"path": "p", "digest": "0" * 64},
            "generation": {"group_size": 2, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0},
            "reward": {"names": [], "weights": []}, "policy_version": 0, "heartbeat_seconds": 1.0, "vocab_size": 8,
        })


def test_an_actor_runs_only_its_own_copy_of_the_learners_environment(tmp_path: Path) -> None:
    from grpo_fleet.actor.admission import ActorRefused
    from grpo_fleet.actor.episodes import plan_env
    from grpo_fleet.tasks.env_module import env_digest

    path = tmp_path / "quiz.py"
    path.write_text("class Quiz:\n    def init(self, p): return p, {}\n    def step(self, a): return {}\n")
    spec = m.EnvSpec(module=str(path), class_name="Quiz", module_digest=env_digest(str(path)), max_turns=2,
                     max_episode_tokens=64)
    assert plan_env(spec, [str(tmp_path)]).module == str(path)
    with pytest.raises(ActorRefused, match="outside the allowed directories"):
        plan_env(spec, [str(tmp_path / "elsewhere")])
    path.write_text(path.read_text() + "# changed\n")
    with pytest.raises(ActorRefused, match="differs from the learner's"):
        plan_env(spec, [str(tmp_path)])
    shipped = m.EnvSpec(module="grpo_fleet.envs.capital_quiz", class_name="CapitalQuiz", max_turns=2,
                        module_digest=env_digest("grpo_fleet.envs.capital_quiz"), max_episode_tokens=64)
    assert plan_env(shipped, []).class_name == "CapitalQuiz"  # an installed module needs no --model-dir
