"""Intake: a finished trajectory checked against the coordinator's own records before it counts.

A rollout worker's result is hostile until checked: a bug, a corrupt frame or someone else on the
network can send anything. The coordinator looks a result up in its own request record (the
trajectory id dispatched to that slice and not finished yet: coordinator.py); `check` then
compares the rest with that record and with the run's limits, and `accepted` builds the
trajectory that enters the run from the record's own group, prompt and version. A result that
fails a check fails its slice (its requests are re-dispatched), never the run or the ledger.

What is checked, and why each matters downstream:
- group, prompt (id and tokens) and version equal the request's: a sample must never land in
  another group (that group would hold G + 1 samples and the other wait forever);
- as many log-probs as response tokens, and no more tokens than the request's `max_new_tokens`:
  the trainer's batch packing refuses a mismatch (dora_jax/trainer/batching.py), and it would be
  saved in every checkpoint after it;
- the response continues the request's prefix (a re-dispatched request's tokens so far);
- token ids in [0, vocab_size) (when the run knows its vocabulary): the trainer embeds them;
- log-probs finite and <= LOGPROB_TOLERANCE: they enter the importance ratio exp(new - old);
- behaviour log-probs, when the slice scored them (trainer.behaviour_logps = "rollout"): one per
  response token, finite, <= LOGPROB_TOLERANCE, with the digest (a short string) of the params that
  scored them; they are the trainer's behaviour policy as they are. A bad set fails the result like
  any other field (not dropped for the trainer to recompute): a slice that scores wrongly is broken,
  and what else it sends is not to be trusted either;
- versions_seen sorted, one per sampling version, within [the request's version, the newest a
  token of it may have]: the auditor reads C1 from it;
- decode_s finite and >= 0 (legacy fill's pace takes the longest);
- the error text bounded (it is written to the ledger).
"""

from __future__ import annotations

import dataclasses
import math

from dora_jax.core.records import Request, Trajectory

# Log-probs above 0 by at most this are float rounding, not a corrupt value. The engine's float32
# log_softmax is <= 0 exactly (x - max <= 0, and log of a sum that holds exp(0) = 1 is >= 0), but
# an engine that forms the normaliser another way (a fused kernel, another summation order) can
# land a few float32 ulps of the row's log-normaliser above 0 for a near-certain token: |lse| < 100
# gives ulps below 8e-6, so a few of them stay well under 1e-4. A ratio exp(1e-4) = 1.0001 moves
# no update; anything larger is not a probability.
LOGPROB_TOLERANCE = 1e-4
MAX_ERROR_CHARS = 500  # a trajectory's error text kept (it goes to the ledger)
MAX_SHOWN_CHARS = 80  # of a worker's string quoted in a refusal (it goes to logs)
MAX_DIGEST_CHARS = 128  # a params digest (dora_jax.store.digest) is far shorter; it goes to the ledger


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """`value` as a log may quote it: escaped (no newline or control character can forge a line)
    and at most `limit` characters of it, saying how many more there were."""
    text = value if isinstance(value, str) else str(value)
    more = f"...(+{len(text) - limit} chars)" if len(text) > limit else ""
    return repr(text[:limit]) + more


def check(traj: Trajectory, request: Request, *, newest_version: int, vocab_size: int) -> str | None:
    """None when `traj` is a result `request` may have; else what is wrong, in a few words.
    `newest_version`: the newest version that may have sampled one of its tokens: the version its
    slice has loaded (which, where the mode keeps C1, is the request's own), or under partial
    rollout the newest published one (a request resumed from a checkpoint carries tokens of
    versions newer than the one it is dispatched with and to). `vocab_size` 0: ids unchecked."""
    for problem in (
        _identity(traj, request),
        _lengths(traj, request),
        _tokens(traj.response_ids, vocab_size),
        _logprobs(traj.logprobs),
        _behaviour(traj),
        _versions(traj, request.version, newest_version),
    ):
        if problem:
            return problem
    if not (isinstance(traj.decode_s, int | float) and math.isfinite(traj.decode_s) and traj.decode_s >= 0):
        return f"decode_s={shown(traj.decode_s)}; expected a finite number >= 0"
    return None


def accepted(traj: Trajectory, request: Request, slice_id: int) -> Trajectory:
    """The trajectory that enters the run: group, prompt and version from the coordinator's own
    request, the slice that posted it, and its error text bounded."""
    error = traj.error if traj.error is None else str(traj.error)[:MAX_ERROR_CHARS]
    return dataclasses.replace(
        traj,
        group_id=request.group_id,
        prompt_id=request.prompt_id,
        prompt_ids=request.prompt_ids,
        version=request.version,
        slice_id=slice_id,
        error=error,
    )


def _identity(traj: Trajectory, request: Request) -> str | None:
    for field, got, want in (
        ("group_id", traj.group_id, request.group_id),
        ("prompt_id", traj.prompt_id, request.prompt_id),
        ("version", traj.version, request.version),
    ):
        if got != want:
            return f"{field}={shown(got)} but it was dispatched with {shown(want)}"
    if tuple(traj.prompt_ids) != request.prompt_ids:
        return f"its {len(traj.prompt_ids)} prompt tokens differ from the {len(request.prompt_ids)} dispatched"
    return None


def _lengths(traj: Trajectory, request: Request) -> str | None:
    tokens, logprobs = len(traj.response_ids), len(traj.logprobs)
    if tokens != logprobs:
        return f"{tokens} response tokens but {logprobs} log-probs"
    if tokens > request.max_new_tokens:
        return f"{tokens} response tokens; the request allows max_new_tokens={request.max_new_tokens}"
    prefix = request.prefix_response_ids
    if prefix and tuple(traj.response_ids[: len(prefix)]) != prefix:
        return f"its response does not continue the {len(prefix)} tokens it was re-dispatched with"
    return None


def _reduce(values, name: str):
    """`min`, `max` or `sum` of `values`: the sequence's own method where it has one (an array, or
    the simulator's constant run `sim.rollout_slice.Repeated`, whose reductions cost O(1)), else the
    builtin, which loops in C (a worker's tuple; what arrives over gRPC is decoded into those)."""
    own = getattr(values, name, None)
    if callable(own):
        return own()
    return {"min": min, "max": max, "sum": sum}[name](values)


def _tokens(ids, vocab_size: int) -> str | None:
    if not ids:
        return None
    try:  # a response may hold thousands of tokens (the simulator's runs, millions in all)
        low, high = _reduce(ids, "min"), _reduce(ids, "max")
    except TypeError:
        return "a response token id that is not a number"
    if low < 0 or (vocab_size and high >= vocab_size):
        bad = low if low < 0 else high
        return f"response token id {shown(bad)} outside the vocabulary [0, {vocab_size or 'inf'})"
    return None


def _logprobs(logprobs) -> str | None:
    if not logprobs:
        return None
    try:
        total = _reduce(logprobs, "sum")  # any NaN or infinity makes the sum one (a hot path)
    except TypeError:
        return "a log-prob that is not a number"
    if not math.isfinite(total):
        bad = next((x for x in logprobs if not math.isfinite(x)), None)
        return f"log-prob {bad}; expected finite" if bad is not None else "log-probs below the float range"
    if (top := _reduce(logprobs, "max")) > LOGPROB_TOLERANCE:
        return f"log-prob {top:.6g} > 0 (tolerance {LOGPROB_TOLERANCE:g})"
    return None


def _behaviour(traj: Trajectory) -> str | None:
    """The slice-scored behaviour log-probs: none at all, or one per response token, finite and <= 0
    (within LOGPROB_TOLERANCE), with the digest of the params that scored them."""
    logprobs, digest = traj.behaviour_logprobs, traj.behaviour_digest
    if logprobs is None:
        return None if digest is None else "behaviour_digest without behaviour_logprobs"
    if not isinstance(digest, str) or not 0 < len(digest) <= MAX_DIGEST_CHARS:
        return f"behaviour_digest={shown(digest)}; expected the scoring params' digest, 1-{MAX_DIGEST_CHARS} chars"
    if len(logprobs) != len(traj.response_ids):
        return f"{len(traj.response_ids)} response tokens but {len(logprobs)} behaviour log-probs"
    problem = _logprobs(logprobs)
    return f"behaviour {problem}" if problem else None


def _versions(traj: Trajectory, low: int, high: int) -> str | None:
    seen = traj.versions_seen
    if not all(type(v) is int for v in seen):  # noqa: E721
        return "a versions_seen entry that is not an integer"
    if bool(seen) != bool(traj.response_ids) or len(seen) > len(traj.response_ids):
        return f"versions_seen has {len(seen)} versions for {len(traj.response_ids)} response tokens"
    if any(a >= b for a, b in zip(seen, seen[1:])):
        return f"versions_seen {shown(list(seen))} is not sorted without repeats"
    if seen and (seen[0] < low or seen[-1] > high):
        window = f"v{low}" if low == high else f"v{low}..v{high}"
        return f"sampled by versions {shown(list(seen))}; its slice could sample it only with {window}"
    return None
