"""The verifiers and OpenEnv adapters' mapping onto init/step, driven by hand on environments written in each
ecosystem's own style (tests/ecosystem_envs.py), in this process."""

from __future__ import annotations

import importlib
import signal
import sys
import threading
import time
import types

import pytest

from ecosystem_envs import OPENENV_ENV, VERIFIERS_ENV, VERIFIERS_TOOL_ENV, import_module_from
from grpo_fleet.envs.protocol import EnvError, checked_init, checked_step

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of Kenya?"}]
CALL = '<tool_call>{"name": "lookup", "arguments": {"country": "Kenya"}}</tool_call>'


@pytest.fixture
def verifiers_envs(tmp_path, monkeypatch):
    """The adapter module, with the two verifiers environments importable by id."""
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed: pip install 'grpo-fleet[verifiers]'")
    import_module_from(tmp_path, "vf_once_more", VERIFIERS_ENV, monkeypatch)
    import_module_from(tmp_path, "vf_capital_tools", VERIFIERS_TOOL_ENV, monkeypatch)
    from grpo_fleet.envs.adapters import verifiers_env

    return verifiers_env


@pytest.fixture
def openenv_module(tmp_path, monkeypatch):
    pytest.importorskip("openenv", reason="the openenv extra is not installed: pip install 'grpo-fleet[openenv]'")
    import_module_from(tmp_path, "oe_length_echo", OPENENV_ENV, monkeypatch)
    from grpo_fleet.envs.adapters import openenv_env

    return openenv_env


def test_a_multiturn_env_gives_its_env_response_then_its_rubric_score_at_the_end(verifiers_envs):
    env = verifiers_envs.VerifiersEnv({"env_id": "vf-once-more"}, {"answer": "Nairobi", "max_turns": 4})
    assert checked_init(env.init(PROMPT)) == PROMPT
    first = checked_step(env.step("Hello"))
    assert (first.observations, first.reward, first.done) == ([{"role": "user", "content": "Once more."}], 0.0, False)
    last = checked_step(env.step("Hello!!"))  # 7 characters: the rubric's (7 % 3) / 2
    assert (last.observations, last.reward, last.done) == ([], 0.5, True)
    assert last.metadata["stop_condition"] == "max_turns_reached"


def test_task_max_turns_caps_the_environments_own_and_the_rollout_is_scored_there(verifiers_envs):
    env = verifiers_envs.VerifiersEnv({"env_id": "vf-once-more", "env_args": {"max_turns": 5}},
                                      {"answer": "Nairobi", "max_turns": 1})
    env.init(PROMPT)
    result = checked_step(env.step("Hi"))
    assert (result.reward, result.done) == (1.0, True)


def test_an_environment_loads_on_a_worker_thread_and_leaves_the_hosts_signals_alone(verifiers_envs):
    sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    failures: list = []

    def load() -> None:  # envs/pool.py runs calls on worker threads, where signal.signal raises
        try:
            verifiers_envs.VerifiersEnv({"env_id": "vf-once-more", "env_args": {"max_turns": 3}}, {"max_turns": 9})
        except Exception as exc:
            failures.append(exc)

    worker = threading.Thread(target=load)
    worker.start()
    worker.join()
    verifiers_envs.VerifiersEnv({"env_id": "vf-once-more", "env_args": {"max_turns": 4}}, {"max_turns": 9})
    assert failures == []
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == (sigterm, sigint)


def test_episodes_that_start_together_share_one_load_and_a_failed_load_fails_each_alike(verifiers_envs, monkeypatch):
    real, loads = verifiers_envs.vf.load_environment, []

    def slow_load(env_id: str, **env_args: object) -> object:
        loads.append(env_id)
        time.sleep(0.3)
        if env_args.get("max_turns") == 6:
            raise RuntimeError("no such dataset")
        return real(env_id, **env_args)

    monkeypatch.setattr(verifiers_envs.vf, "load_environment", slow_load)
    config = {"env_id": "vf-once-more", "env_args": {"max_turns": 5}}
    workers = [threading.Thread(target=verifiers_envs.VerifiersEnv, args=(config, {"max_turns": 9})) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert loads == ["vf-once-more"]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no such dataset"):
            verifiers_envs.VerifiersEnv({"env_id": "vf-once-more", "env_args": {"max_turns": 6}}, {"max_turns": 9})
    assert loads == ["vf-once-more", "vf-once-more"]


def test_a_tool_env_runs_the_tool_the_reply_calls_and_scores_the_final_answer(verifiers_envs):
    env = verifiers_envs.VerifiersEnv({"env_id": "vf_capital_tools"}, {"answer": "Nairobi", "max_turns": 4})
    env.init(PROMPT)
    called = checked_step(env.step(f"Let me look. {CALL}"))
    assert called.observations == [{"role": "tool", "content": "Nairobi", "tool_call_id": "call_1_0"}]
    assert not called.done
    answered = checked_step(env.step("It is Nairobi."))
    assert (answered.reward, answered.done) == (1.0, True)
    assert answered.metadata["metrics"]["lookup_calls"] == 1


def test_a_tool_call_that_cannot_be_read_is_plain_text_so_a_tool_env_ends_there(verifiers_envs):
    env = verifiers_envs.VerifiersEnv({"env_id": "vf_capital_tools"}, {"answer": "Nairobi", "max_turns": 4})
    env.init(PROMPT)
    result = checked_step(env.step('<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>'))
    assert (result.reward, result.done, result.metadata["stop_condition"]) == (0.0, True, "no_tools_called")


def test_replies_are_parsed_into_every_tool_call_or_none():
    pytest.importorskip("verifiers", reason="the verifiers extra is not installed: pip install 'grpo-fleet[verifiers]'")
    from grpo_fleet.envs.adapters.verifiers_client import as_response, tool_calls

    assert [(c.id, c.name, c.arguments) for c in tool_calls(f"{CALL} and {CALL}", 3)] == [
        ("call_3_0", "lookup", '{"country": "Kenya"}'), ("call_3_1", "lookup", '{"country": "Kenya"}')]
    assert tool_calls(f"{CALL} <tool_call>not json</tool_call>", 1) == []
    assert tool_calls("<tool_call>{\"name\": \"lookup\"}", 1) == []  # never closed
    message = as_response(f"Checking. {CALL}", "m", 1, parse_calls=True).message
    assert (message.content, message.finish_reason) == ("Checking.", "tool_calls")
    assert as_response(CALL, "m", 1, parse_calls=False).message.tool_calls is None  # an env with no tools


def test_closing_an_unfinished_episode_cancels_its_rollout(verifiers_envs):
    env = verifiers_envs.VerifiersEnv({"env_id": "vf-once-more"}, {"answer": "Nairobi", "max_turns": 4})
    env.init(PROMPT)
    env.close()
    assert env.rollout is not None and env.rollout.task is not None and env.rollout.task.cancelled()


def test_bad_verifiers_settings_are_one_line_errors(verifiers_envs):
    for config, says in [({"env_id": "envs/my_env.py"}, "not a file path"), ({}, "env_id = None"),
                         ({"env_id": "vf-once-more", "envargs": {}}, "not ['envargs']"),
                         ({"env_id": "vf-once-more", "env_args": [1]}, "must be a table")]:
        with pytest.raises(EnvError, match="task.env_config") as caught:
            verifiers_envs.VerifiersEnv(config, {"max_turns": 2})
        assert says in str(caught.value) and "\n" not in str(caught.value)


def test_group_level_rubrics_and_non_multiturn_environments_are_refused(verifiers_envs):
    import verifiers as vf
    from datasets import Dataset

    async def ranks(completions: list, **kwargs: object) -> list:
        return [0.0] * len(completions)

    data = Dataset.from_list([{"question": "q", "answer": "a"}])
    grouped = vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[ranks]))
    with pytest.raises(EnvError, match="scores whole groups"):
        verifiers_envs.checked(grouped, "grouped", 2)
    with pytest.raises(EnvError, match="not a MultiTurnEnv"):
        verifiers_envs.checked(object(), "other", 2)


def test_an_environment_that_rewrites_its_history_is_refused(verifiers_envs):
    env = verifiers_envs.VerifiersEnv({"env_id": "vf-once-more"}, {"answer": "Nairobi", "max_turns": 4})
    env.init(PROMPT)
    env.sent = [{"role": "user", "content": "something else"}]  # as if the rollout had rewritten the prompt
    with pytest.raises(EnvError, match="does not continue the conversation"):
        env.step("Hello")


def test_an_openenv_environment_maps_reset_and_step_with_reward_and_done_through(openenv_module):
    env = openenv_module.OpenEnvEnv({"environment": "oe_length_echo:LengthEcho", "env_args": {"turns": 2}},
                                    {"answer": "Nairobi"})
    conversation, info = env.init(PROMPT)
    assert checked_init((conversation, info)) == PROMPT  # the learner's prompt opens it, as it rendered it
    assert info == {"observation": "Say something."}  # the reset observation is not shown
    first = checked_step(env.step("Hello"))  # 5 characters: (5 % 3) / 2
    assert (first.observations, first.reward, first.done) == ([{"role": "user", "content": "You said: Hello"}], 1.0,
                                                              False)
    last = checked_step(env.step("Hi"))
    assert (last.observations, last.reward, last.done) == ([], 1.0, True)
    env.close()


def test_reset_gets_the_example_columns_it_names(openenv_module, monkeypatch):
    env = openenv_module.OpenEnvEnv({"environment": "oe_length_echo:LengthEcho"}, {"seed": 7, "answer": "x"})
    seen = {}
    original = env.env.reset
    monkeypatch.setattr(env.env, "reset", lambda seed=None, episode_id=None: seen.update(seed=seed) or original())
    env.init(PROMPT)
    assert seen == {"seed": 7}


def test_an_observation_with_several_fields_is_read_as_json(openenv_module):
    from openenv.core.env_server.types import Observation

    class Board(Observation):
        cells: str
        score: int

    text = openenv_module.observation_text(Board(cells="x.o", score=2, reward=1.0), None)
    assert text == '{"cells": "x.o", "score": 2}'
    assert openenv_module.observation_text(Board(cells="x.o", score=2), "cells") == "x.o"


def test_an_openenv_environment_that_needs_one_thread_is_refused(openenv_module, monkeypatch):
    monkeypatch.setattr(sys.modules["oe_length_echo"].LengthEcho, "REQUIRES_SINGLE_THREAD_EXECUTOR", True)
    with pytest.raises(EnvError, match="REQUIRES_SINGLE_THREAD_EXECUTOR"):
        openenv_module.OpenEnvEnv({"environment": "oe_length_echo:LengthEcho"}, {})


def test_bad_openenv_settings_are_one_line_errors(openenv_module):
    for config, says in [({"environment": "oe_length_echo.py:LengthEcho"}, "expected 'package.module:ClassName'"),
                         ({"environment": "oe_length_echo:State"}, "not an OpenEnv Environment"),
                         ({"environment": "oe_length_echo:LengthEcho", "action_field": "text"}, "has no such field"),
                         ({"environment": "oe_length_echo:LengthEcho", "reset": {}}, "not ['reset']")]:
        with pytest.raises(EnvError) as caught:
            openenv_module.OpenEnvEnv(config, {})
        assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_verifiers_without_multiturn_env_is_refused_in_one_line(monkeypatch):
    newer = types.ModuleType("verifiers")  # 0.4.0's root: no MultiTurnEnv, no load_environment of that kind
    newer.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "verifiers", newer)
    monkeypatch.delitem(sys.modules, "grpo_fleet.envs.adapters.verifiers_client", raising=False)
    with pytest.raises(ImportError, match=r"verifiers 0.4.0 has no MultiTurnEnv .*pins 0.3.1") as caught:
        importlib.import_module("grpo_fleet.envs.adapters.verifiers_client")
    assert "\n" not in str(caught.value)


def test_an_episode_dropped_without_close_has_its_rollout_cancelled(verifiers_envs):
    import gc

    env = verifiers_envs.VerifiersEnv({"env_id": "vf-once-more"}, {"answer": "Nairobi", "max_turns": 4})
    env.init(PROMPT)
    rollout = env.rollout
    del env  # as the host drops an episode whose call timed out
    gc.collect()
    for _ in range(100):
        if rollout.task.done():
            break
        time.sleep(0.01)
    assert rollout.task.cancelled()


@pytest.mark.parametrize("extra, plain, deterministic", [
    ("verifiers", "verifiers_env:VerifiersEnv", "verifiers_env:DeterministicVerifiersEnv"),
    ("openenv", "openenv_env:OpenEnvEnv", "openenv_env:DeterministicOpenEnvEnv")])
def test_the_learner_replays_only_the_deterministic_adapters(extra, plain, deterministic):
    pytest.importorskip(extra, reason=f"the {extra} extra is not installed: pip install 'grpo-fleet[{extra}]'")
    from grpo_fleet.learner.verify.env_replay import EnvNotVerifiable, check_verifiable
    from grpo_fleet.tasks.env_module import EnvSetup

    def setup(spec: str) -> EnvSetup:
        module, class_name = spec.split(":")
        return EnvSetup(module=f"grpo_fleet.envs.adapters.{module}", class_name=class_name)

    with pytest.raises(EnvNotVerifiable, match="does not declare itself deterministic"):
        check_verifiable(setup(plain), verify_rewards=True)
    check_verifiable(setup(plain), verify_rewards=False)
    check_verifiable(setup(deterministic), verify_rewards=True)
