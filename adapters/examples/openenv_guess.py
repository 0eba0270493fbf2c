"""A small OpenEnv environment (written for miles-env's adapter tests): guess the secret word.

reset(seed) picks a word; each step's action {"message": text} earns reward 1.0 and
ends the episode when the text contains the word, else 0.0 (at most 3 steps).
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["apple", "river", "stone", "cloud"]


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.word = WORDS[0]

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Say the word '{self.word}'.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        hit = self.word in action.message.lower()
        done = hit or self._state.step_count >= 3
        prompt = "Correct." if hit else f"No. Say the word '{self.word}'."
        return GuessObservation(prompt=prompt, done=done, reward=1.0 if hit else 0.0)

    @property
    def state(self) -> State:
        return self._state


def app() -> Any:
    return create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
