"""The coordinator's scorer seam over a task's RewardPool: trajectory -> (reward, error) future.

Used by the embedded runner and the gRPC coordinator (`dora_jax.serve_coordinator`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from dora_jax.core.records import Trajectory


class RewardPoolScorer:
    """Decodes the response, scores it in the pool; a failure is a masked sample, never a crash."""

    def __init__(self, pool, prompts: dict, decode: Callable):
        self._pool, self._prompts, self._decode = pool, prompts, decode

    def submit(self, trajectory: Trajectory) -> Future:
        out: Future = Future()
        prompt = self._prompts.get(trajectory.prompt_id)
        try:
            text = self._decode(trajectory.response_ids)
        except Exception as err:  # undecodable response
            out.set_result((0.0, f"decode error: {err}"))
            return out
        inner = self._pool.submit(trajectory.traj_id, (prompt, text))
        inner.add_done_callback(lambda f: out.set_result(_unpack(f)))
        return out


def _unpack(future: Future):
    try:
        result = future.result()
    except Exception as err:
        return 0.0, f"reward pool error: {err}"
    return float(result.value), result.error
