"""Every experiment config in configs/ still parses (`dora_jax.runtime.run_config.parse`), and every `pod`
section still fits its meshes (`launch.pod.from_config`): a config that drifts from the code fails
here instead of at the start of a paid TPU run."""

import pytest

from dora_jax.runtime import run_config
from dora_jax.runtime.run_config import task_config
from launch import pod as pod_lib
from tests.launch.configs import CONFIG_DIR, load

# Configs of other programs than the RL run, and the program that reads each.
NOT_RUN_CONFIGS = {"sim_paper.py": "python -m dora_jax.sim"}

CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.py"))


def test_the_exceptions_exist():
    assert set(NOT_RUN_CONFIGS) <= set(CONFIGS)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in NOT_RUN_CONFIGS])
def test_config_parses(name):
    c = load(name)
    config = run_config.parse(c)
    assert config.num_steps >= 1
    task_config(config)  # the task section: its kind and the prompt source's fields
    if "pod" in c:
        pod = pod_lib.from_config(c)
        assert pod.nodes[0].tpu.chips >= 1


def test_real_experiment_configs_have_a_pod_and_their_sizes_hold():
    for name, layout, slots in [
        ("qwen2_5_0_5b_gsm8k.py", "single_host", 4 * 96),
        ("qwen2_5_7b_dapo.py", "slices", 4 * 256),
        ("qwen3_30b_a3b.py", "slices", 4 * 128),
    ]:
        c = load(name)
        config = run_config.parse(c)
        pod = pod_lib.from_config(c)
        assert pod.layout.value == layout
        assert config.rollout.num_slices * config.rollout.slots == slots == config.coordinator.rollout_batch_size
        assert config.rollout.max_new_tokens + config.rollout.max_prefill_length <= config.rollout.cache_length
        assert c.task.source.max_prompt_tokens == config.rollout.max_prefill_length


def test_task_fallback_last_number_reaches_the_task_config():
    c = load("qwen2_5_0_5b_gsm8k.py")
    assert task_config(run_config.parse(c)).fallback_last_number is False
    c.task.fallback_last_number = True
    assert task_config(run_config.parse(c)).fallback_last_number is True
    smoke = load("smoke.py")
    assert task_config(run_config.parse(smoke)).fallback_last_number is False  # absent: off
    with smoke.unlocked():
        smoke.task.fallback_last_number = True
    with pytest.raises(ValueError, match="fallback_last_number=True: reward 'running_sums'"):
        task_config(run_config.parse(smoke))
