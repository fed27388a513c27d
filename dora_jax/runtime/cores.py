"""Which cores each role's processes run on when a machine's cores are split between roles, as a
pod gives the trainer and the rollout slices their own chips (`launch_local --trainer_cores`)."""

from __future__ import annotations


def role_cores(trainer_cores: int, available: list[int]) -> dict[str, list[int]]:
    """{"trainer": the first `trainer_cores` of `available`, "rollout": the rest}; {} for 0."""
    if trainer_cores == 0:
        return {}
    if not 0 < trainer_cores < len(available):
        raise ValueError(
            f"--trainer_cores={trainer_cores}; this launcher may use {len(available)} cores {available}: "
            f"expected 1..{len(available) - 1}, leaving the rollout workers at least one"
        )
    return {"trainer": available[:trainer_cores], "rollout": available[trainer_cores:]}
