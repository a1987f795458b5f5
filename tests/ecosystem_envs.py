"""Environments as their own ecosystems write them, importing only verifiers or only openenv, never grpo_fleet.

Each is the source of a module the tests write to a folder on PYTHONPATH (verifiers loads an environment by its id,
an importable module; the OpenEnv adapter imports the class by "module:Class"). The rewards follow the reply's
length, as tests/helpers.LENGTHS_ENV does, so the tiny model's replies give a group different rewards.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

# A verifiers MultiTurnEnv: feedback after the first reply, two turns, its rubric scores the last reply's length.
VERIFIERS_ENV = '''
import verifiers as vf
from datasets import Dataset


class OnceMore(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Once more.")]


def last_reply_length(completion, answer):
    replies = [message["content"] or "" for message in completion if message["role"] == "assistant"]
    return (len(replies[-1]) % 3) / 2 if replies else 0.0


CAPITALS = {"Kenya": "Nairobi", "Peru": "Lima", "Japan": "Tokyo", "Chile": "Santiago", "Egypt": "Cairo",
            "Spain": "Madrid", "Nepal": "Kathmandu", "Ghana": "Accra"}


def load_environment(max_turns=2, **kwargs):
    dataset = Dataset.from_list([{"question": f"What is the capital of {country}?", "answer": city}
                                 for country, city in CAPITALS.items()])
    return OnceMore(dataset=dataset, rubric=vf.Rubric(funcs=[last_reply_length]), max_turns=max_turns, **kwargs)
'''

# A verifiers ToolEnv: one tool; the rubric pays for an answer naming the capital after the tool said it.
VERIFIERS_TOOL_ENV = '''
import verifiers as vf
from datasets import Dataset

CAPITALS = {"Kenya": "Nairobi", "Peru": "Lima"}


def lookup(country: str) -> str:
    """The capital of a country."""
    return CAPITALS[country]


def names_capital(completion, answer):
    return 1.0 if answer in (completion[-1]["content"] or "") else 0.0


def load_environment(**kwargs):
    dataset = Dataset.from_list([{"question": "What is the capital of Kenya?", "answer": "Nairobi"}])
    return vf.ToolEnv(dataset=dataset, tools=[lookup], rubric=vf.Rubric(funcs=[names_capital]), max_turns=4)
'''

# An OpenEnv environment: an echo that scores the reply's length and ends after two steps.
OPENENV_ENV = '''
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""


class LengthEcho(Environment[EchoAction, EchoObservation, State]):
    def __init__(self, turns: int = 2):
        super().__init__()
        self.turns = turns
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="Say something.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        done = self._state.step_count >= self.turns
        return EchoObservation(echoed_message=f"You said: {action.message}", done=done,
                               reward=(len(action.message) % 3) / 2)

    @property
    def state(self):
        return self._state
'''


def write_module(folder: Path, name: str, source: str) -> Path:
    """Write `source` as `folder/name.py`; the folder is what PYTHONPATH gets."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


def import_module_from(folder: Path, name: str, source: str, monkeypatch: object) -> ModuleType:
    """Write the module and import it by name, as a user's installed environment is (monkeypatch undoes sys.path)."""
    write_module(folder, name, source)
    monkeypatch.syspath_prepend(str(folder))  # type: ignore[attr-defined]
    sys.modules.pop(name, None)
    return importlib.import_module(name)
