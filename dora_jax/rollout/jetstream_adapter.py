"""Serves a `RolloutEngine` through JetStream's own orchestrator (`Driver`) and gRPC server.

This is the only module that imports `jetstream` (the google-jetstream package, 0.2.2: its last
release). Two differences between that release and our engine are bridged here:
  * 0.2.2's `Engine.prefill` returns only a Prefix and its Driver emits tokens from `generate`
    alone (newer JetStream and our engine also return the first token from prefill). So the
    adapter prefills all prompt tokens but the last and leaves the last one pending
    (`sample_first=False`): the first `generate` samples the first response token, and the client
    receives every token.
  * Its orchestrator calls `jax.tree_map`, removed in jax 0.10: aliased below before the import.
The Driver kills the whole process when an engine call raises in one of its threads, so a request
our engine refuses (too long, token ids outside the vocabulary) is answered with an empty stream
(logged), never an exception.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
import jax
import numpy as np

# JetStream 0.2.2's orchestrator calls `jax.tree_map` (removed in jax 0.10): without this alias the
# Driver's generate thread dies and the Driver then SIGKILLs the process. Must precede the import.
if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map

# Importing the orchestrator sets the root logger to DEBUG and adds a stdout handler to it; undone
# right after, so that importing this adapter does not change the logging of the whole process.
_root = logging.getLogger()
_root_level, _root_handlers = _root.level, list(_root.handlers)
from jetstream.core import orchestrator, server_lib  # noqa: E402

_root.setLevel(_root_level)
for _handler in [h for h in _root.handlers if h not in _root_handlers]:
    _root.removeHandler(_handler)
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

from dora_jax.core.records import SamplingParams  # noqa: E402
from dora_jax.rollout.engine import DecodeState, Prefix, RolloutEngine  # noqa: E402

_NO_BOS = -1  # reported as bos_id for models without a BOS token; prefill drops it again
_NEVER = 1 << 30  # a prefix whose length count is already past any max_tokens: an empty answer


class TokenizerAdapter(tokenizer_api.Tokenizer):
    """Our tokenizer (HFTokenizer / CharTokenizer, or None for token-id-only clients) behind
    JetStream's Tokenizer API; stop tokens are the model's EOS ids (not JetStream's eos + pad)."""

    def __init__(self, tokenizer: Any, *, bos_id: int | None, eos_ids: Sequence[int], pad_id: int = 0):
        self._tokenizer = tokenizer
        self._bos = _NO_BOS if bos_id is None else bos_id
        self._eos = tuple(eos_ids)
        self._pad = pad_id

    def encode(self, s: str, **kwargs):
        if self._tokenizer is None:
            raise ValueError("this server has no tokenizer; send token_content, not text_content")
        return token_utils.pad_tokens(
            np.asarray(self._tokenizer.encode(s), np.int32),
            self.bos_id,
            self.pad_id,
            is_bos=kwargs.pop("is_bos", True),
            prefill_lengths=kwargs.pop("prefill_lengths", None),
            max_prefill_length=kwargs.pop("max_prefill_length", None),
            jax_padding=kwargs.pop("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return "" if self._tokenizer is None else self._tokenizer.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos[0] if self._eos else -1

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._eos)


class JetStreamEngine(engine_api.Engine):
    """A RolloutEngine as a JetStream 0.2.2 Engine. `params` (already loaded with
    `engine.load_params`) are what `load_params()` returns, as JetStream's server calls it bare."""

    def __init__(
        self,
        engine: RolloutEngine,
        params: Any = None,
        *,
        sampling: SamplingParams | None = None,
        eos_ids: Sequence[int] | None = None,
    ):
        full = engine.config.num_slots * engine.config.pages_per_slot + 1
        if engine.config.paged and engine.config.pool_pages < full:
            # JetStream's Driver decodes every slot it filled and cannot preempt: a pool that runs
            # dry mid-decode would end the process from the Driver's thread.
            raise ValueError(
                f"engine.num_pages={engine.config.pool_pages} holds fewer pages than every slot at "
                f"cache_length ({full}); JetStream's Driver cannot preempt a request: expected a pool of "
                f"{full} pages (rollout.kv_pages=0 sized to it, or a dense cache)"
            )
        self.engine = engine
        self._params = params
        self._sampling = sampling or engine.config.default_sampling
        eos = engine.model_config.eos_ids if eos_ids is None else tuple(eos_ids)
        self._tokenizer = TokenizerAdapter(engine.get_tokenizer(), bos_id=engine.model_config.bos_token_id, eos_ids=eos)

    def prefill(
        self, *, params, existing_prefix: Prefix | None = None, padded_tokens, true_length: int, sampler=None
    ) -> Prefix:
        tokens = np.asarray(padded_tokens).reshape(-1)[:true_length]
        if tokens.size and tokens[0] == _NO_BOS:
            tokens = tokens[1:]
        try:
            prefix, _ = self.engine.prefill(
                params=params,
                existing_prefix=existing_prefix,
                padded_tokens=tokens,
                true_length=len(tokens),
                sampler=sampler,
                sampling=self._sampling,
                sample_first=False,
            )
        except ValueError as err:
            logging.error("JetStream request refused (answered with no tokens): %s", err)
            prefix, _ = self.engine.prefill(
                params=params,
                padded_tokens=np.zeros((1,), np.int32),
                true_length=1,
                sampling=self._sampling,
                sample_first=False,
            )
            prefix = prefix.replace(generated=jax.device_put(np.int32(_NEVER), prefix.generated.sharding))
        return prefix

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        return self.engine.insert(prefix, decode_state, slot)

    def generate(self, params, decode_state: DecodeState, sampler=None):
        decode_state, result = self.engine.generate(params, decode_state, sampler)
        return decode_state, engine_api.ResultTokens(
            data=result.data,
            tokens_idx=result.tokens_idx,
            valid_idx=result.valid_idx,
            length_idx=result.length_idx,
            samples_per_slot=result.samples_per_slot,
        )

    def free_resource(self, slot: int) -> Any:
        return self.engine.free_resource(slot)

    def load_params(self, *args, **kwargs) -> Any:
        if args or kwargs:
            self._params = self.engine.load_params(*args, **kwargs)
        if self._params is None:
            raise ValueError("no params: pass them to JetStreamEngine(...) or load_params(params=...)")
        return self._params

    def get_prefix_destination_sharding(self) -> Any:
        return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="dora_jax")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerAdapter:
        return self._tokenizer

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        return self.engine.init_decode_state()

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return self.engine.samples_per_slot

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        return self.engine.colocated_cpus


def make_driver(engine: JetStreamEngine) -> orchestrator.Driver:
    """JetStream's Driver with `engine` for both prefill and generate (interleaved mode)."""
    params = engine.load_params()
    return orchestrator.Driver(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[params],
        generate_params=[params],
        interleaved_mode=True,
    )


def serve(engine: JetStreamEngine, port: int, *, credentials=None, threads: int = 16) -> server_lib.JetStreamServer:
    """Starts JetStream's gRPC server (its Orchestrator service) on `port`; `.stop()` ends it."""
    server = server_lib.JetStreamServer(
        make_driver(engine), threads, port, credentials or grpc.insecure_server_credentials()
    )
    server.start()
    return server
