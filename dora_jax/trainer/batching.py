"""Groups of scored trajectories -> one padded `TrainBatch` whose shapes repeat across steps.

Row b holds prompt then response, right-padded with `pad_id` to T positions. The response token
at position t gets loss_mask[b, t] = 1 and its inference log-prob at inference_logps[b, t]
(aligned on the predicted token). T is a bucket, `pad_to * 2^k` for the smallest k that fits the
longest row, so a run sees only a handful of shapes (one when `pad_to` covers the longest
possible sample); `num_rows` pads the batch with empty invalid rows for a fixed row count.
"""

from __future__ import annotations

import numpy as np

from dora_jax.core.records import Group, TrainBatch
from dora_jax.tasks.reward_shaping import RewardShaping


def bucket_length(longest: int, pad_to: int, cap: int | None = None) -> int:
    """The smallest `pad_to * 2^k` >= `longest`, or `cap` (>= `longest`) where that is smaller."""
    if pad_to < 1:
        raise ValueError(f"pad_to={pad_to}; expected >= 1")
    if cap is not None and cap < longest:
        raise ValueError(f"cap={cap} is shorter than the row of {longest} positions it must hold")
    length = pad_to
    while length < longest:
        length *= 2
    return length if cap is None else min(length, cap)


def make_train_batch(
    groups: list[Group],
    pad_to: int,
    pad_id: int,
    *,
    num_rows: int | None = None,
    max_length: int | None = None,
    shaping: RewardShaping = RewardShaping(),
    overlong_filter: bool = False,
) -> TrainBatch:
    """Packs `groups` (each G samples of one prompt and one version) into a TrainBatch, as wide as
    `pad_to * 2^k` over its longest row, or `max_length` (the longest row rollout can make) where
    that is narrower.

    Rewards are the training rewards of `shaping` (DAPO's overlong punishment, a failed grade's
    score): rejected samples, and failed grades under reward_on_error "mask", get valid = 0 (kept in
    place, masked out of the loss). `overlong_filter` (DAPO): a sample cut at the length cap keeps
    its reward in its group's statistics but has no loss tokens. `group_ids_B` number the groups
    0..len(groups)-1 in order.
    """
    samples = [(g, s) for g, group in enumerate(groups) for s in group.samples]
    B = len(samples) if num_rows is None else num_rows
    if len(samples) > B:
        raise ValueError(f"{len(samples)} samples do not fit num_rows={num_rows}")
    for _, s in samples:
        if not s.trajectory.prompt_ids:
            raise ValueError(f"trajectory {s.trajectory.traj_id} has an empty prompt; nothing predicts its first token")
        if len(s.trajectory.logprobs) != len(s.trajectory.response_ids):
            raise ValueError(
                f"trajectory {s.trajectory.traj_id} has {len(s.trajectory.response_ids)} response tokens "
                f"but {len(s.trajectory.logprobs)} log-probs"
            )
        scored = s.trajectory.behaviour_logprobs
        if scored is not None and len(scored) != len(s.trajectory.response_ids):
            raise ValueError(
                f"trajectory {s.trajectory.traj_id} has {len(s.trajectory.response_ids)} response tokens "
                f"but {len(scored)} behaviour log-probs"
            )
    longest = max((len(s.trajectory.prompt_ids) + s.trajectory.num_tokens for _, s in samples), default=1)
    T = bucket_length(longest, pad_to, max_length if max_length is not None and max_length >= longest else None)

    tokens = np.full((B, T), pad_id, np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    inference_logps = np.zeros((B, T), np.float32)
    behaviour_logps, behaviour_known = np.zeros((B, T), np.float32), np.zeros(B, bool)
    rewards, valid = np.zeros(B, np.float32), np.zeros(B, np.float32)
    truncated, penalties, errors = np.zeros(B, np.float32), np.zeros(B, np.float32), np.zeros(B, np.float32)
    versions, group_ids = np.zeros(B, np.int64), np.zeros(B, np.int32)
    traj_ids = []
    for b, (g, s) in enumerate(samples):
        traj, shaped = s.trajectory, shaping.shape(s)
        P, R = len(traj.prompt_ids), traj.num_tokens
        tokens[b, :P] = traj.prompt_ids
        tokens[b, P : P + R] = traj.response_ids
        loss_mask[b, P : P + R] = 0.0 if overlong_filter and shaped.truncated else 1.0
        inference_logps[b, P : P + R] = traj.logprobs
        if traj.behaviour_logprobs is not None:
            behaviour_logps[b, P : P + R], behaviour_known[b] = traj.behaviour_logprobs, True
        rewards[b], valid[b], penalties[b] = shaped.reward, float(shaped.valid), shaped.penalty
        truncated[b], errors[b] = float(shaped.truncated), float(shaped.reward_error)
        versions[b] = traj.version
        group_ids[b] = g
        traj_ids.append(traj.traj_id)
    if samples:  # padding rows: version of the newest sample (no extra recompute group), own group
        versions[len(samples) :] = versions[: len(samples)].max()
        group_ids[len(samples) :] = len(groups)
    traj_ids += [""] * (B - len(samples))
    return TrainBatch(
        tokens_BT=tokens,
        loss_mask_BT=loss_mask,
        inference_logps_BT=inference_logps,
        rewards_B=rewards,
        valid_B=valid,
        versions_B=versions,
        group_ids_B=group_ids,
        traj_ids=tuple(traj_ids),
        truncated_B=truncated,
        overlong_penalty_B=penalties,
        reward_error_B=errors,
        behaviour_logps_BT=behaviour_logps,
        behaviour_known_B=behaviour_known,
    )
