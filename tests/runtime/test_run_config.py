"""run_config: the schema (every field typed, defaulted and described; unknown keys and wrong
types refused by name), every shipped config parsing to the specs it parsed to before the schema
(run_config_golden.json), and the DAPO fields: the trainer takes the rollout's temperature,
truncated sampling is refused by name unless the config says how the ratio treats it, and the
reward fields parse or are refused naming the field."""

import dataclasses
import json
import pathlib

import ml_collections
import pytest

from dora_jax.runtime import run_config
from dora_jax.trainer import TrainerConfig
from tests.helpers import tiny_config
from tests.launch.configs import load

GOLDEN = pathlib.Path(__file__).with_name("run_config_golden.json")


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


def parse_replacing(**fields):
    """tiny_config("dora") with `fields` ("group.name" or "name": value) written as a config file
    would: a value of another type than the smoke config's (ConfigDict's overrides refuse that)."""
    c = tiny_config("dora")
    with c.unlocked():
        for name, value in fields.items():
            group_name, _, key = name.rpartition(".")
            group = c[group_name] if group_name else c
            if key in group:
                del group[key]
            group[key] = value
    return run_config.parse(c)


def flatten(value, prefix: str = "") -> dict[str, str]:
    """{dotted path: repr} of a parsed config's leaves (dataclasses and config groups recursed)."""
    if dataclasses.is_dataclass(value):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, ml_collections.ConfigDict):
        items = list(value.items())
    else:
        return {prefix: repr(value)}
    out = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else key))
    return out


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_every_shipped_config_parses_to_the_specs_it_did_before_the_schema(name):
    """The golden values were written by the positional parse the schema replaced (every field of
    every spec, as repr: 2 and 2.0 differ). A field added since is not in them and not compared."""
    expected = json.loads(GOLDEN.read_text())[name]
    parsed = flatten(run_config.parse(load(name)))
    assert {path: parsed.get(path) for path in expected} == expected


def test_every_field_has_a_type_and_a_description():
    sections = run_config.schema()
    assert {"", "model", "rollout", "coordinator", "trainer", "eval", "log"} <= set(sections)
    for fields in sections.values():
        for field in fields:
            assert field.help.strip(), f"{field.path} has no description"
            assert field.type is not object, f"{field.path} has no type"
    # Sections read into classes owned elsewhere carry their descriptions on those classes' fields.
    assert dataclasses.fields(TrainerConfig)[0].metadata["help"] == "AdamW peak learning rate"
    listing = run_config.describe()
    assert "trainer.lr" in listing and "AdamW peak learning rate" in listing and "rollout.slots" in listing


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("trainer.lrr", 1e-5, "trainer.lrr: unknown field; did you mean trainer.lr?"),
        ("rollout.num_slice", 2, "rollout.num_slice: unknown field; did you mean rollout.num_slices?"),
        ("num_step", 3, "num_step: unknown field; did you mean num_steps?"),
        ("eval.sample", 2, "eval.sample: unknown field; did you mean eval.samples?"),
        ("task.source_", {}, "task.source_: unknown field; did you mean task.source?"),
        ("coordinator.seed", 3, "coordinator.seed=3; not a config field: the coordinator takes seed"),
        ("model.zzz", 1, "model.zzz: unknown field; see `python -m dora_jax.runtime.run_config`"),
    ],
)
def test_an_unknown_key_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=f"^{_escaped(message)}$"):
        parse_replacing(**{field: value})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("trainer.lr", "fast", "trainer.lr='fast'; expected a number"),
        ("rollout.slots", 4.0, "rollout.slots=4.0; expected an int"),
        ("model.scan_layers", "yes", "model.scan_layers='yes'; expected True or False"),
        ("trainer.dual_clip", "off", "trainer.dual_clip='off'; expected a number or None"),
        ("log.wandb_tags", "a", "log.wandb_tags='a'; expected a sequence of strings"),
        ("num_steps", True, "num_steps=True; expected an int"),
        ("model.dtype", 16, "model.dtype=16; expected a string"),
    ],
)
def test_a_wrong_type_is_refused_naming_the_field_the_value_and_the_type(field, value, message):
    with pytest.raises(ValueError, match=f"^{_escaped(message)}$"):
        parse_replacing(**{field: value})


def test_a_mesh_shape_and_the_task_source_are_checked_inside():
    c = tiny_config("dora")
    with c.unlocked():
        c.mesh.trainer = ml_collections.ConfigDict({"fsdp": 2.0})
    with pytest.raises(ValueError, match=r"^mesh.trainer.fsdp=2.0; expected an int$"):
        run_config.parse(c)
    c = load("qwen2_5_0_5b_gsm8k.py")
    with c.unlocked():
        c.task.source.prompt_feild = "q"
    with pytest.raises(
        ValueError, match=r"task.source.prompt_feild: unknown field; did you mean task.source.prompt_field"
    ):
        run_config.parse(c)


def test_a_config_sets_only_what_differs_from_the_defaults():
    c = ml_collections.ConfigDict()
    c.num_steps = 3
    c.model = dict(hf_path="", num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)
    c.model.update(head_dim=16, dtype="float32", param_dtype="float32")
    c.task = dict(kind="running_sums", median_k=2.0, sigma=1.0, k_max=8, reward_workers=1, reward_timeout_s=5.0)
    c.mesh = dict(trainer={"fsdp": 1}, rollout={"tensor": 1})
    c.rollout = dict(num_slices=1, slots=2, cache_length=64, max_prefill_length=32, max_new_tokens=16)
    c.trainer = dict(pad_to=16)
    config = run_config.parse(c)
    from dora_jax.trainer import TrainerConfig

    assert config.trainer == TrainerConfig() and config.mode == "dora" and config.seed == 0
    assert (config.eval, config.log, config.init) == (
        run_config.EvalSpec(),
        run_config.LogSpec(),
        run_config.InitSpec(),
    )
    assert (config.coordinator.k_max, config.coordinator.train_batch_size, config.checkpoint_keep) == (2, 16, 3)
    assert config.rollout.sampling.temperature == 1.0 and config.mesh.time_shared is False
    with c.unlocked():
        del c.rollout["slots"]
    with pytest.raises(ValueError, match=r"^rollout.slots: missing; expected an int \(concurrent decodes per slice\)$"):
        run_config.parse(c)


def _escaped(message: str) -> str:
    import re

    return re.escape(message)
