"""`TaskConfig` and the one factory that turns it into a prompt source and a reward function.

Kinds:
  running_sums  synthetic, char-level (`running_sums.ALPHABET`); reward `running_sums`
  gsm8k         a JSONL / Parquet / HF-disk file; numeric final answer; reward `numeric`
  math          MATH / DAPO-Math style file; LaTeX answers checked by math-verify; `math_verify`
Both answer rewards read the stated answer (`math_answers.grade`, docs/grading.md); the last number
of an answer-less response only with `fallback_last_number`.
Reward functions are chosen by name from `REWARD_FUNCTIONS`, all `(prompt, response_text) ->
float` top-level functions, so a `RewardPool` can run any of them in worker processes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable

from dora_jax.tasks import math_answers, running_sums
from dora_jax.tasks.prompt import Prompt, PromptSource, Tokenizer
from dora_jax.tasks.reward_pool import RewardPool
from dora_jax.tasks.running_sums import RunningSumsConfig, RunningSumsSource
from dora_jax.tasks.sources import FileSource, SourceConfig

RewardFn = Callable[[Prompt, str], float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "running_sums": running_sums.reward,
    "numeric": math_answers.numeric_reward,
    "math_verify": math_answers.math_verify_reward,
}
# Modules a reward worker imports before it takes work, so the first sample's timeout does not
# pay for them (math-verify pulls in sympy: about a second).
REWARD_PRELOAD: dict[str, tuple[str, ...]] = {"math_verify": ("math_verify",)}
# Packages a reward needs, checked when the task is made: (module, pip requirement).
REWARD_REQUIRES: dict[str, tuple[str, str]] = {"math_verify": ("math_verify", "math-verify")}
DEFAULT_REWARD: dict[str, str] = {"running_sums": "running_sums", "gsm8k": "numeric", "math": "math_verify"}
# Rewards that read a stated answer (math_answers.grade) and so can fall back to the last number.
FALLBACK_REWARDS = frozenset({"numeric", "math_verify"})


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    kind: str = "running_sums"  # "running_sums" | "gsm8k" | "math"
    running_sums: RunningSumsConfig = RunningSumsConfig()  # used by kind running_sums
    source: SourceConfig | None = None  # the prompt file; required by gsm8k and math
    reward: str | None = None  # a REWARD_FUNCTIONS name; None: the kind's default
    # A response that states no answer (no \boxed{}, `Answer:` line or `#### N`) is graded by its
    # last number instead of scoring 0. Off by default: a truncated "We have 2 apples and then"
    # would otherwise be right against 2. Only for the answer-reading rewards (FALLBACK_REWARDS).
    fallback_last_number: bool = False

    def __post_init__(self):
        if self.kind not in DEFAULT_REWARD:
            raise ValueError(f"TaskConfig.kind={self.kind!r}: must be one of {sorted(DEFAULT_REWARD)}")
        if self.reward is not None and self.reward not in REWARD_FUNCTIONS:
            raise ValueError(f"TaskConfig.reward={self.reward!r}: must be one of {sorted(REWARD_FUNCTIONS)}")
        if self.fallback_last_number and self.reward_name not in FALLBACK_REWARDS:
            raise ValueError(
                f"TaskConfig.fallback_last_number=True: reward {self.reward_name!r} reads its own format; "
                f"the fallback applies to rewards {sorted(FALLBACK_REWARDS)}"
            )
        if self.kind != "running_sums" and self.source is None:
            raise ValueError(
                f"TaskConfig.source is required for kind {self.kind!r} (a SourceConfig "
                "naming the prompt file and its fields)"
            )

    @property
    def reward_name(self) -> str:
        return self.reward or DEFAULT_REWARD[self.kind]


@dataclasses.dataclass(frozen=True)
class Task:
    """A prompt stream and the reward that grades its responses."""

    kind: str
    source: PromptSource
    reward_name: str
    reward_fn: RewardFn
    reward_preload: tuple[str, ...] = ()

    def make_reward_pool(self, num_workers: int = 2, timeout_s: float = 30.0) -> RewardPool:
        """A `RewardPool` running this task's reward; close it when done."""
        return RewardPool(self.reward_fn, num_workers, timeout_s, preload=self.reward_preload)


def make_task(config: TaskConfig, tokenizer: Tokenizer) -> Task:
    """The prompt source and reward for `config`. For running_sums, `tokenizer` must encode
    `running_sums.ALPHABET` (use `CharTokenizer(running_sums.ALPHABET)`)."""
    name = config.reward_name
    if name in REWARD_REQUIRES:
        module, requirement = REWARD_REQUIRES[name]
        if importlib.util.find_spec(module) is None:
            raise ImportError(
                f"reward {name!r} (TaskConfig.kind={config.kind!r}) needs the {requirement} "
                f"package: pip install {requirement}"
            )
    match config.kind:
        case "running_sums":
            source: PromptSource = RunningSumsSource(config.running_sums, tokenizer)
        case "gsm8k" | "math":
            assert config.source is not None  # checked in TaskConfig
            source = FileSource(config.source, tokenizer)
        case _:
            raise AssertionError(config.kind)
    reward_fn = REWARD_FUNCTIONS[name]
    if config.fallback_last_number:  # a partial of a top-level function still pickles by reference
        reward_fn = functools.partial(reward_fn, fallback_last_number=True)
    return Task(config.kind, source, name, reward_fn, REWARD_PRELOAD.get(name, ()))
