"""run_config's DAPO fields: the trainer takes the rollout's temperature, truncated sampling is
refused by name unless the config says how the ratio treats it, and the reward fields parse or are
refused naming the field."""

import pytest

from dora_jax.runtime import run_config
from tests.helpers import tiny_config


def parse_with(**fields):
    """tiny_config("dora") with `fields` ("group.name": value) set."""
    c = tiny_config("dora")
    with c.unlocked():
        for name, value in fields.items():
            group, key = name.split(".")
            c[group][key] = value
    return run_config.parse(c)


def test_the_trainer_takes_the_rollout_temperature():
    config = parse_with(**{"rollout.temperature": 0.7})
    assert config.trainer.temperature == 0.7 and config.trainer.loss_config().temperature == 0.7
    assert parse_with(**{"rollout.temperature": 0.0}).trainer.temperature == 1.0  # greedy: the raw logits
    assert parse_with().trainer.temperature == 1.0
    with pytest.raises(ValueError, match=r"trainer.temperature=0.5; not a config field: the trainer takes rollout"):
        parse_with(**{"trainer.temperature": 0.5})


@pytest.mark.parametrize("field, value", [("rollout.top_p", 0.9), ("rollout.top_k", 20)])
def test_truncated_sampling_is_refused_unless_the_ratio_is_stated(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value}.*trainer.truncated_sampling_ratio='ignore'"):
        parse_with(**{field: value})
    config = parse_with(**{field: value, "trainer.truncated_sampling_ratio": "ignore"})
    assert config.rollout.engine_config().sampling_filters
    with pytest.raises(
        ValueError, match=r"trainer.truncated_sampling_ratio='drop'; expected one of \('refuse', 'ignore'\)"
    ):
        parse_with(**{"trainer.truncated_sampling_ratio": "drop"})


def test_reward_fields():
    shaping = parse_with().reward_shaping
    assert (shaping.max_response_tokens, shaping.overlong_penalty_tokens, shaping.reward_on_error) == (40, 0, 0.0)
    config = parse_with(
        **{"task.overlong_penalty_tokens": 8, "task.reward_on_error": "mask", "trainer.overlong_filter": True}
    )
    assert config.reward_shaping.overlong_penalty_tokens == 8 and config.reward_shaping.reward_on_error is None
    assert config.trainer.overlong_filter
    assert parse_with(**{"task.reward_on_error": -1}).reward_shaping.reward_on_error == -1.0
    with pytest.raises(ValueError, match=r"task.reward_on_error='masked'; expected a finite number"):
        parse_with(**{"task.reward_on_error": "masked"})
    with pytest.raises(ValueError, match=r"task.overlong_penalty_tokens=41; expected 0 \(off\) or at most rollout"):
        parse_with(**{"task.overlong_penalty_tokens": 41})


def test_the_dapo_config_turns_on_the_papers_knobs():
    from tests.launch.configs import load

    config = run_config.parse(load("qwen2_5_7b_dapo.py"))
    trainer, shaping = config.trainer, config.reward_shaping
    assert (trainer.eps_low, trainer.eps_high, trainer.loss_norm) == (0.2, 0.28, "token_mean")
    assert trainer.dynamic_sampling and trainer.overlong_filter and trainer.kl_coef == 0.0
    # The paper's L_cache / L_max = 4096 / 20480, at this config's response cap.
    assert shaping.overlong_penalty_tokens == int(config.rollout.max_new_tokens * 4096 / 20480) == 1638
    assert shaping.reward_on_error == 0.0 and trainer.temperature == 1.0
