"""The Trainer: state born sharded on the trainer mesh, one jitted step, versions in and out.

`Trainer.train_step(batch)` recomputes behaviour log-probs per generating version (from the
ParamStore), runs `step.train_step` jitted with explicit shardings and a donated state, counts
skipped (non-finite) updates and returns `StepMetrics`. `Trainer.version` is the step counter and
the version of the current params; `publish()` stores them under that version.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.core.records import TrainBatch
from dora_jax.core.schema import setting
from dora_jax.models.params import in_compute_dtype
from dora_jax.parallel.sharding import (
    TRAINER_RULES,
    Rules,
    activation_layout,
    logical_to_spec,
    replicated,
    tree_shardings,
)
from dora_jax.store import ParamStore
from dora_jax.store.digest import params_digest
from dora_jax.trainer.advantages import ESTIMATORS
from dora_jax.trainer.ahead import AheadLogps, HeldGrads, row_keys
from dora_jax.trainer.bucketed import BucketedStep, batch_widths
from dora_jax.trainer.loss import LossConfig, LossStats
from dora_jax.trainer.recompute import BehaviourLogps
from dora_jax.trainer.step import (
    OptimizerConfig,
    StepInputs,
    TrainState,
    init_state,
    make_optimizer,
    make_schedule,
    train_step,
)

# trainer.truncated_sampling_ratio: what a training run with top-p/top-k filtering does (see TrainerConfig).
TRUNCATED_SAMPLING_RATIOS = ("refuse", "ignore")
# trainer.behaviour_logps: who computes the behaviour log-probs (see TrainerConfig).
BEHAVIOUR_SOURCES = ("trainer", "rollout", "sampler")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    # Optimizer (counts are optimizer updates: num_updates per batch).
    lr: float = setting("AdamW peak learning rate", 1e-6)
    warmup_steps: int = setting("linear warm-up updates", 0)
    schedule: str = setting("constant | cosine after warm-up", "constant")
    decay_steps: int = setting("cosine: updates from start to the end of decay", 10_000)
    final_lr_fraction: float = setting("cosine: end lr = lr * this", 0.1)
    b1: float = setting("AdamW beta1", 0.9)
    b2: float = setting("AdamW beta2", 0.999)
    adam_eps: float = setting("AdamW epsilon", 1e-8)
    weight_decay: float = setting("AdamW weight decay", 0.01)
    clip_grad_norm: float | None = setting("global-norm gradient clip (None = off)", 1.0)
    # Loss (see dora_jax.trainer.loss).
    eps_low: float = setting("PPO clip below", 0.2)
    eps_high: float = setting("PPO clip above (DAPO clip-higher)", 0.28)
    dual_clip: float | None = setting("dual-clip bound for negative advantages (None = off)", 3.0)
    tis_cap: float | None = setting("truncated importance weight cap (0 or None = off)", None)
    loss_norm: str = setting("token_mean | seq_mean_token_mean | constant", "token_mean")
    t_max: int = setting('the constant of loss_norm="constant"', 4096)
    kl_coef: float = setting("k3 KL to the initial params (0 = off: no reference kept)", 0.0)
    router_aux_coef: float = setting(
        "MoE load-balancing loss weight (0 = off: the router trains through the policy loss)", 0.0
    )
    vocab_chunk: int = setting("log-probs over the vocabulary this many entries at a time", LossConfig.vocab_chunk)
    # Advantages (see dora_jax.trainer.advantages).
    advantage: str = setting("grpo | dr_grpo | rloo", "grpo")
    dynamic_sampling: bool = setting(
        "DAPO: the coordinator trains only groups with reward variance, drawing more", False
    )
    # Batching.
    num_updates: int = setting("optimizer updates per batch (the batch is split into this many)", 1)
    micro_batch_size: int = setting("rows per forward/backward (and per recompute chunk)", 8)
    # Length buckets: rows sorted by length, each micro-batch padded to its own N * 2^k
    # (dora_jax.trainer.bucketed); with a token budget, long rows go few to a micro-batch, short many.
    length_bucket: int = setting(
        "0: rows padded to the batch's length; N: micro-batches of like lengths padded to N * 2^k", 0
    )
    micro_batch_tokens: int = setting(
        "with length_bucket: 0 = micro_batch_size rows each; N = rows fitting N positions", 0
    )
    max_nonfinite_in_a_row: int = setting("raise after this many skipped (non-finite) updates in a row", 3)
    # (the first update's forward only), not a recompute
    reuse_current_logps: bool = setting("current-version rows: behaviour log-probs from the step's own forward", True)
    # "rollout": each slice scores its finished trajectories with this trainer's forward under their
    # own version (dora_jax.rollout.scoring) while its devices would idle; the trainer uses those and
    # recomputes only rows that arrive without them (their slice's scoring failed, or several
    # versions sampled them: partial rollout), each with its own version as before.
    # "sampler": the behaviour log-probs are the engine's own log-probs of the tokens it sampled (the
    # inference log-probs every trajectory carries), so nobody computes them: no recompute, no
    # scoring forward. Exact where decode and the training forward agree (fp32: within 5e-7 per
    # token here, tests/rollout/test_rollout_scoring.py); in bf16 the ratio then absorbs the
    # engine/trainer mismatch that the TIS weight corrects otherwise (that weight becomes 1).
    behaviour_logps: str = setting(
        "trainer | rollout | sampler: who computes behaviour log-probs (rollout: the generating slice "
        "scores them; sampler: the engine's log-probs of the sampled tokens)",
        "trainer",
    )
    # While the trainer waits for its batch, it computes the behaviour log-probs of the finished
    # groups the coordinator will hand it (dora_jax.trainer.ahead); the step then recomputes only
    # the rows that arrived since. One-process trainers only (the hosts of a multi-host trainer
    # would have to wait in step).
    score_ahead: bool = setting("compute behaviour log-probs of finished groups while waiting for the batch", False)
    # While the trainer waits for its batch (C3 holds it for an old version's last group), it
    # computes the gradients of the whole groups the coordinator commits to that batch, at the params
    # the step will have; the step computes only the other rows and makes one update of the sum
    # (dora_jax.trainer.ahead.HeldGrads; every loss_norm is a per-row weight times one batch-level
    # factor, applied when the batch is whole). Needs length_bucket, num_updates = 1 and
    # router_aux_coef = 0; one-process trainers only, as score_ahead.
    grad_ahead: bool = setting("compute the gradients of committed groups while waiting for the batch", False)
    # The rollout's sampling temperature T: every log-prob the trainer takes (current policy,
    # behaviour recompute, KL reference) is of softmax(logits / T), as the engine's inference
    # log-probs are. Set by dora_jax.runtime.run_config from rollout.temperature, not by hand.
    temperature: float = 1.0
    # How the ratio treats rollout.top_p < 1 or rollout.top_k > 0 (checked by run_config, which knows
    # the sampling): "refuse" = such a training run is refused; "ignore" = the ratio uses the
    # untruncated temperature-scaled distribution (engine and trainer alike), the filter's truncation
    # left out of the importance weights.
    truncated_sampling_ratio: str = setting(
        "with top_p/top_k: refuse | ignore (the ratio uses the untruncated distribution)", "refuse"
    )
    overlong_filter: bool = setting("DAPO: samples cut at rollout.max_new_tokens are masked from the loss", False)

    @property
    def recomputes(self) -> bool:
        """Whether a step may recompute behaviour log-probs, and so needs recompute programs: not
        under "sampler", where every row comes with its sampling log-probs."""
        return self.behaviour_logps != "sampler"

    def __post_init__(self):
        self.loss_config()  # validates the loss fields
        make_optimizer(self.optimizer_config())  # validates the schedule fields
        if self.advantage not in ESTIMATORS:
            raise ValueError(f"trainer.advantage={self.advantage!r}; expected one of {ESTIMATORS}")
        if self.truncated_sampling_ratio not in TRUNCATED_SAMPLING_RATIOS:
            raise ValueError(
                f"trainer.truncated_sampling_ratio={self.truncated_sampling_ratio!r}; expected one of "
                f"{TRUNCATED_SAMPLING_RATIOS}"
            )
        if self.behaviour_logps not in BEHAVIOUR_SOURCES:
            raise ValueError(f"trainer.behaviour_logps={self.behaviour_logps!r}; expected one of {BEHAVIOUR_SOURCES}")
        if self.score_ahead and self.behaviour_logps == "sampler":
            raise ValueError(
                'trainer.score_ahead=True with trainer.behaviour_logps="sampler": every row\'s behaviour '
                "log-probs arrive with it, so there is nothing to score ahead; set one of them"
            )
        if self.grad_ahead:
            needs = {
                "trainer.length_bucket > 0 (micro-batches of their own length)": self.length_bucket > 0,
                "trainer.num_updates = 1 (one update: its params are the ones waiting)": self.num_updates == 1,
                "trainer.router_aux_coef = 0 (its loss is a mean over all micro-batches)": self.router_aux_coef == 0,
                "trainer.score_ahead = False (grad_ahead computes its rows' log-probs itself)": not self.score_ahead,
            }
            missing = [need for need, ok in needs.items() if not ok]
            if missing:
                raise ValueError(f"trainer.grad_ahead=True needs {'; '.join(missing)}")
        if self.router_aux_coef < 0:
            raise ValueError(f"trainer.router_aux_coef={self.router_aux_coef}; expected >= 0")
        if self.length_bucket < 0:
            raise ValueError(f"trainer.length_bucket={self.length_bucket}; expected 0 (off) or a pad multiple >= 1")
        if self.micro_batch_tokens < 0 or (self.micro_batch_tokens and not self.length_bucket):
            raise ValueError(
                f"trainer.micro_batch_tokens={self.micro_batch_tokens}; expected 0 (off), or a token budget >= 1 "
                f"together with trainer.length_bucket > 0 (it sizes the length-bucketed micro-batches)"
            )
        for name in ("num_updates", "micro_batch_size", "max_nonfinite_in_a_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(self, name)}; expected >= 1")

    def loss_config(self) -> LossConfig:
        return LossConfig(
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip,
            tis_cap=self.tis_cap,
            loss_norm=self.loss_norm,
            t_max=self.t_max,
            kl_coef=self.kl_coef,
            vocab_chunk=self.vocab_chunk,
            temperature=self.temperature,
        )

    def optimizer_config(self) -> OptimizerConfig:
        names = [f.name for f in dataclasses.fields(OptimizerConfig)]
        return OptimizerConfig(**{name: getattr(self, name) for name in names})


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    version: int  # the trainer's version after this step
    loss: float
    grad_norm: float  # before clipping, mean over the step's updates
    lr: float  # the learning rate of the step's last update
    clip_frac_low: float
    clip_frac_high: float
    clip_frac_dual: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    tis_mean: float
    tis_max: float
    entropy: float
    kl: float
    skipped_updates: int  # non-finite updates skipped in this step
    nonfinite_in_a_row: int
    dropped_groups: int  # DAPO dynamic sampling
    loss_tokens: int  # response tokens of valid samples
    tokens_per_s: float  # loss_tokens / step_time_s
    step_time_s: float
    staleness: dict[int, int]  # trainer version - generating version -> samples
    recomputed_rows: int = 0  # rows whose behaviour log-probs were recomputed (the rest: the step's own forward)
    rollout_scored_rows: int = 0  # rows whose behaviour log-probs came scored by their rollout slice
    sampler_rows: int = 0  # rows whose behaviour log-probs are the engine's sampling log-probs
    ahead_rows: int = 0  # rows whose behaviour log-probs the trainer computed while it waited (score_ahead)
    grad_ahead_rows: int = 0  # rows whose gradient the trainer computed while it waited (grad_ahead)
    grad_ahead_dropped: int = 0  # rows computed ahead and not used: the batch did not hold them as they were
    # MoE only (None for a dense model), over the step's loss tokens:
    expert_load: tuple[tuple[int, ...], ...] | None = None  # per MoE layer: assignments per expert
    router_load_ratio: tuple[float, ...] | None = None  # per MoE layer: max / mean expert load (1 = balanced)
    router_aux_loss: float | None = None  # load-balancing loss (K when balanced), optimised iff router_aux_coef > 0
    # generating version -> digest of the params its behaviour log-probs were recomputed with
    behaviour_digests: dict[int, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """Flat scalars; a MoE adds router/aux_loss, router/load_ratio_max, router/load_ratio/{layer}
        and the histogram router/expert_load/{layer} (a list of counts)."""
        moe = ("expert_load", "router_load_ratio", "router_aux_loss")
        flat = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("staleness", "behaviour_digests") and k not in moe
        }
        flat.update({f"staleness/{k}": v for k, v in sorted(self.staleness.items())})
        if self.expert_load is not None:
            flat["router/aux_loss"] = self.router_aux_loss
            flat["router/load_ratio_max"] = max(self.router_load_ratio)
            for layer, (load, ratio) in enumerate(zip(self.expert_load, self.router_load_ratio)):
                flat[f"router/load_ratio/{layer}"] = ratio
                flat[f"router/expert_load/{layer}"] = list(load)
        return flat


class Trainer:
    """GRPO/DAPO trainer over one mesh. `params` are live buffers: the next step donates them."""

    def __init__(
        self,
        graphdef,
        params,
        axes,
        mesh: Mesh,
        config: TrainerConfig = TrainerConfig(),
        store: ParamStore | None = None,
        *,
        rules: Rules = TRAINER_RULES,
        version: int = 0,
        compiler_options: Mapping[str, Any] | None = None,
    ):
        """`version` is the version of `params` (0 for a fresh run, the checkpoint's on resume);
        `compiler_options` go to every jit (XLA debug options, e.g. TPU scheduler flags)."""
        self._build(graphdef, params, axes, mesh, config, store, rules, version, compiler_options)
        placed = jax.device_put(params, self.param_shardings, may_alias=False)
        self._ref_params = placed if config.kl_coef > 0 else None
        self._state = self._init_jit(placed)

    @classmethod
    def abstract(
        cls,
        graphdef,
        params,
        axes,
        mesh: Mesh,
        config: TrainerConfig = TrainerConfig(),
        *,
        rules: Rules = TRAINER_RULES,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> Trainer:
        """A Trainer over abstract `params` (ShapeDtypeStructs, e.g. `jax.eval_shape` of a model
        init): the same jits and shardings as the real one, its state ShapeDtypeStructs carrying
        those shardings, no device memory. For ahead-of-time compilation (the `lower_*` methods,
        dora_jax.runtime.aot); it cannot step."""
        trainer = cls.__new__(cls)
        trainer._build(graphdef, params, axes, mesh, config, None, rules, 0, compiler_options)
        placed = _with_shardings(params, trainer.param_shardings)
        trainer._ref_params = placed if config.kl_coef > 0 else None
        trainer._state = _with_shardings(jax.eval_shape(trainer._init_jit, placed), trainer.state_shardings)
        return trainer

    def _build(self, graphdef, params, axes, mesh, config, store, rules, version, compiler_options) -> None:
        """Shardings and jitted programs (everything but the state itself)."""
        self.config, self.mesh, self._store, self._version = config, mesh, store, int(version)
        self._compiler_options = dict(compiler_options or {}) or None
        self._nonfinite_in_a_row = 0
        self._schedule = make_schedule(config.optimizer_config())
        self.trace_counts: collections.Counter[str] = collections.Counter()
        # The mesh axes rows are split over: the "batch" rule's leading axes that divide the
        # micro-batch (`expert` takes rows too when micro_batch_size is a multiple of data x fsdp
        # x expert; data x fsdp must divide it).
        every = np.atleast_1d(logical_to_spec(("batch",), (mesh.devices.size,), mesh, rules)[0] or ())
        needed = int(np.prod([mesh.shape[a] for a in every if a != "expert"]))
        if config.micro_batch_size % needed:
            raise ValueError(
                f"trainer.micro_batch_size={config.micro_batch_size} must be a multiple of the mesh's "
                f"{needed} batch shards"
            )
        batch_axes = logical_to_spec(("batch",), (config.micro_batch_size,), mesh, rules)[0]
        shards = int(np.prod([mesh.shape[a] for a in np.atleast_1d(batch_axes or ())]))
        # Every program traces the model under the mesh and rules: activations laid out by their
        # logical axes (rows over the batch axes), the attention kernel mapped over the devices.
        self._layout = functools.partial(activation_layout, mesh, rules)
        self._rows_UMC = NamedSharding(mesh, PartitionSpec(None, None, batch_axes))
        self._rows_UMCT = NamedSharding(mesh, PartitionSpec(None, None, batch_axes, None))
        self._replicated = replicated(mesh)

        # State born sharded: abstract init -> shardings -> jitted init with those out_shardings.
        self._tx = make_optimizer(config.optimizer_config())
        self.param_shardings = tree_shardings(axes, params, mesh, rules)
        init = functools.partial(init_state, tx=self._tx)
        abstract = jax.eval_shape(init, params)
        opt_shardings = optax.tree_map_params(
            self._tx,
            lambda _, s: s,
            abstract.opt_state,
            self.param_shardings,
            transform_non_params=lambda _: self._replicated,
        )
        self.state_shardings = TrainState(
            params=self.param_shardings, opt_state=opt_shardings, updates=self._replicated
        )
        self._init_jit = jax.jit(
            init,
            in_shardings=(self.param_shardings,),
            out_shardings=self.state_shardings,
            donate_argnums=() if config.kl_coef > 0 else (0,),
            compiler_options=self._compiler_options,
        )

        # Versions are published (and the current one recomputed with) in the model's compute dtype:
        # every block casts its params so before use, so no number changes, and rollout slices
        # receive half the bytes of fp32 master weights.
        self.serve_dtype = nnx.merge(graphdef, params).config.dtype
        self._served = jax.jit(
            functools.partial(in_compute_dtype, dtype=self.serve_dtype),
            in_shardings=(self.param_shardings,),
            out_shardings=self.param_shardings,
            compiler_options=self._compiler_options,
        )
        self._digests: dict[int, str] = {}  # version -> params digest (dora_jax.store.digest)
        self._used_digests: dict[int, str] = {}  # those the current step recomputed with
        self._ahead = AheadLogps()  # rows computed while waiting for their batch (score_ahead)
        self._held: HeldGrads | None = None  # gradients computed while waiting for the batch (grad_ahead)
        self._held_dropped = 0  # rows of held gradients dropped since the last step
        self._behaviour = BehaviourLogps(
            graphdef,
            self.param_shardings,
            self._rows_UMCT,
            self._replicated,
            config.micro_batch_size,
            on_trace=lambda: self.trace_counts.update(["recompute"]),
            compiler_options=self._compiler_options,
            layout=self._layout,
            temperature=config.temperature,
            vocab_chunk=config.vocab_chunk,  # the gradient's forward slices the vocabulary so too
        )
        self._step = self._compile_step(graphdef)
        self._bucketed = None
        if config.length_bucket:
            self._bucketed = BucketedStep(
                graphdef,
                self._tx,
                config,
                mesh,
                batch_axes,
                self.param_shardings,
                self.state_shardings,
                self._replicated,
                self._behaviour,
                pad_to=config.length_bucket,
                shards=shards,
                compiler_options=self._compiler_options,
                on_trace=lambda: self.trace_counts.update(["bucketed"]),
                layout=self._layout,
            )

    def _compile_step(self, graphdef):
        config = self.config
        step = functools.partial(
            train_step,
            graphdef=graphdef,
            tx=self._tx,
            loss_config=config.loss_config(),
            estimator=config.advantage,
            dynamic_sampling=config.dynamic_sampling,
            rows_sharding=self._rows_UMC,
            router_aux_coef=config.router_aux_coef,
        )

        def traced(state, inputs, ref_params):
            self.trace_counts["train_step"] += 1
            with self._layout():
                return step(state, inputs, ref_params)

        rows, flat = self._rows_UMCT, self._replicated
        inputs_shardings = StepInputs(rows, rows, rows, rows, flat, flat, flat, self._rows_UMC)
        ref_shardings = self.param_shardings if config.kl_coef > 0 else None
        return jax.jit(
            traced,
            in_shardings=(self.state_shardings, inputs_shardings, ref_shardings),
            out_shardings=(self.state_shardings, self._replicated),
            donate_argnums=(0,),
            compiler_options=self._compiler_options,
        )

    # ----------------------------------------------------------------- public
    @property
    def version(self) -> int:
        return self._version

    @property
    def scores_ahead(self) -> bool:
        """`trainer.score_ahead`, for a one-process trainer (see TrainerConfig)."""
        return self.config.score_ahead and jax.process_count() == 1

    @property
    def grads_ahead(self) -> bool:
        """`trainer.grad_ahead`, for a one-process trainer (see TrainerConfig)."""
        return self.config.grad_ahead and jax.process_count() == 1

    @property
    def params(self):
        return self._state.params

    @property
    def state(self) -> TrainState:
        """The whole train state (params, optimizer state, update count), e.g. to checkpoint."""
        return self._state

    def load_state(self, state: TrainState, version: int) -> None:
        """Replaces the train state (a restored checkpoint) and the version it corresponds to."""
        self._state = jax.device_put(state, self.state_shardings, may_alias=False)
        self._version = int(version)
        self._nonfinite_in_a_row = 0
        if self._held is not None:  # computed with the params replaced
            self._drop_held()

    def warmup(self, max_length: int, batch_size: int, pad_to: int | None = None) -> list[int]:
        """With `length_bucket`, compiles the step of `batch_size`-row batches for every micro-batch
        length a row of up to `max_length` positions can get (returns them); without, nothing to do.
        `pad_to`: the batches' own padding (`make_train_batch`), which caps a micro-batch's length;
        None: batches at least as wide as every bucket. Params are not changed."""
        if self._bucketed is None:
            return []
        widths = (None,) if pad_to is None else batch_widths(max_length, pad_to)
        return self._bucketed.warmup(
            self._state,
            self._ref_params,
            self._version,
            max_length,
            batch_size // self.config.num_updates,
            self._params_of,
            widths,
        )

    def publish(self) -> int:
        """Stores the current params under `version` in the ParamStore, in the compute dtype
        (`serve_dtype`); returns the version."""
        if self._store is None:
            raise ValueError("Trainer.publish() needs a ParamStore; none was given")
        self._store.publish(self._version, self.served_params())
        return self._version

    def served_params(self):
        """The current params as versions are published: in the compute dtype."""
        params = self._state.params
        floating = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
        return params if all(d == self.serve_dtype for d in floating) else self._served(params)

    def behaviour_logps(self, batch: TrainBatch) -> np.ndarray:
        """[B, T] log-probs of each sample under its own generating version (fetched to host)."""
        versions_B = np.asarray(batch.versions_B, np.int64)
        self._check_batch(batch, versions_B)
        logps_UMCT = self._behaviour(self._rows(batch.tokens_BT, np.int32), versions_B, self._params_of)
        # Rows are sharded over the mesh, which may span processes: every host gathers them all.
        return multihost_utils.process_allgather(logps_UMCT, tiled=True).reshape(np.shape(batch.tokens_BT))

    def score_ahead(self, batch: TrainBatch) -> int:
        """Computes the behaviour log-probs of `batch`'s rows that have none yet (not scored by
        their slice, not computed before, not of the current version when the step's own forward
        gives those), to be used when a batch holding these rows comes (`train_step`). The trainer
        calls it while it waits for that batch (`trainer.score_ahead`); `batch` is packed as a
        training batch (its size and widths), with padding rows. Rows of the current version are
        computed too: most are trained after the params move, and a step that trains one before
        takes its own forward's instead (`train_step`). Returns the rows computed."""
        versions_B = np.asarray(batch.versions_B, np.int64)
        self._check_batch(batch, versions_B)
        wanted_B = self._ahead.wanted(batch) & ~self._arrived_rows(batch)
        if not wanted_B.any():
            return 0
        if self._bucketed is not None:
            logps_BT = self._bucketed.behaviour_logps(batch, self._params_of, ~wanted_B)
        else:
            logps_UMCT = self._behaviour(
                self._rows(batch.tokens_BT, np.int32), versions_B, self._params_of, skip_B=~wanted_B
            )
            logps_BT = multihost_utils.process_allgather(logps_UMCT, tiled=True).reshape(np.shape(batch.tokens_BT))
        digests = {int(v): self._digests[int(v)] for v in np.unique(versions_B[wanted_B])}
        self._ahead.store(batch, np.asarray(logps_BT), wanted_B, digests)
        return int(wanted_B.sum())

    def grad_ahead(self, batch: TrainBatch, full_only: bool = False) -> int:
        """Computes, at the current params, the gradient sums of `batch`'s rows (whole groups the
        coordinator committed to the next batch; padding rows and rows held already are skipped),
        and holds them for the step whose batch holds those rows (`trainer.grad_ahead`;
        `HeldGrads`). Their behaviour log-probs are computed here as the step would (recomputed
        with their own version, or taken as they arrived). `batch` is packed as a training batch
        (its size and widths). `full_only`: only the rows of micro-batches they fill (the training
        loop passes every committed group again with the next ones, until the take). Held sums of
        an earlier version are dropped. Returns the rows computed."""
        versions_B = np.asarray(batch.versions_B, np.int64)
        self._check_batch(batch, versions_B)
        if self._held is not None and self._held.version != self._version:
            self._drop_held()
        held = self._held
        rows_B = np.asarray([bool(t) and (held is None or t not in held.keys) for t in batch.traj_ids], bool)
        if not rows_B.any():
            return 0
        batch = self._with_sampler_logps(batch)
        known_B = self._arrived_rows(batch) & rows_B
        current_B = self._current_rows(versions_B) & rows_B & ~known_B
        saved, self._used_digests = self._used_digests, {}
        try:
            part, rows_B = self._bucketed.partial(
                self._state, batch, self._ref_params, self._params_of, rows_B, current_B, known_B, full_only
            )
            known_B &= rows_B
            current_B &= rows_B
            if current_B.any():
                self._params_of(self._version)  # notes the current version's digest for the ledger
            digests = self._used_digests
        finally:
            self._used_digests = saved
        if part is None:
            return 0
        recomputed = int((rows_B & ~known_B & ~current_B).sum())
        keys = row_keys(batch, rows_B)
        if held is None:
            self._held = HeldGrads(self._version, part, keys, dict(digests), recomputed)
        else:
            held.partial = self._bucketed.add(held.partial, part)
            held.keys.update(keys)
            held.digests.update(digests)
            held.recomputed += recomputed
        return int(rows_B.sum())

    def _drop_held(self) -> None:
        self._held_dropped += len(self._held.keys)
        self._held = None

    def _with_sampler_logps(self, batch: TrainBatch) -> TrainBatch:
        """Under `behaviour_logps = "sampler"`, the batch with its inference log-probs as every
        row's behaviour log-probs; otherwise the batch."""
        if self.config.behaviour_logps != "sampler":
            return batch
        return dataclasses.replace(
            batch, behaviour_logps_BT=batch.inference_logps_BT, behaviour_known_B=np.ones(batch.batch_size, bool)
        )

    def train_step(self, batch: TrainBatch) -> StepMetrics:
        versions_B = np.asarray(batch.versions_B, np.int64)
        self._check_batch(batch, versions_B)
        self._used_digests = {}
        start = time.perf_counter()
        batch = self._with_sampler_logps(batch)
        held_B, held = None, self._held
        if held is not None:
            held_B = held.rows_in(batch) if held.version == self._version else None
            if held_B is None:
                self._drop_held()  # the params moved, or the batch does not hold those rows as they were
                held = None
            self._held = None
        arrived_B = self._arrived_rows(batch)
        own_B = self._current_rows(versions_B)  # the step's own forward gives these
        batch, ahead_B, ahead_digests = self._ahead.apply(batch, ~arrived_B & ~own_B)
        self._used_digests.update(ahead_digests)
        known_B = arrived_B | ahead_B  # log-probs at hand: not recomputed
        current_B = own_B & ~known_B
        if held is not None:
            self._used_digests.update(held.digests)
            current_B &= ~held_B
        if current_B.any():
            self._params_of(self._version)  # notes the current version's digest for the ledger
        if held is None:
            rows = (int(versions_B.size - current_B.sum() - known_B.sum()), int(arrived_B.sum()), int(ahead_B.sum()))
        else:
            here = int((~current_B & ~known_B & ~held_B).sum())
            rows = (here + held.recomputed, int(arrived_B.sum()), int(ahead_B.sum()))
        if self._bucketed is not None:
            ahead = None if held is None else (held.partial, held_B)
            self._state, outputs = self._bucketed(
                self._state, batch, self._ref_params, self._params_of, current_B, known_B, ahead=ahead
            )
            metrics = self._finish(jax.device_get(outputs), versions_B, time.perf_counter() - start, rows)
            metrics = dataclasses.replace(
                metrics,
                grad_ahead_rows=0 if held_B is None else int(held_B.sum()),
                grad_ahead_dropped=self._held_dropped,
            )
            self._held_dropped = 0
            return metrics
        tokens_UMCT = self._rows(batch.tokens_BT, np.int32)
        U, C = self.config.num_updates, self.config.micro_batch_size
        arrived_UMCT = None
        if known_B.any():  # the recompute writes only the other rows over these
            arrived_UMCT = self._rows(np.asarray(batch.behaviour_logps_BT) * known_B[:, None], np.float32)
        behaviour_UMCT = self._behaviour(
            tokens_UMCT, versions_B, self._params_of, skip_B=current_B | known_B, initial_UMCT=arrived_UMCT
        )
        inputs = StepInputs(
            tokens_UMCT=tokens_UMCT,
            loss_mask_UMCT=self._rows(batch.loss_mask_BT, np.float32),
            inference_logps_UMCT=self._rows(batch.inference_logps_BT, np.float32),
            behaviour_logps_UMCT=behaviour_UMCT,
            rewards_B=jax.device_put(np.asarray(batch.rewards_B, np.float32), self._replicated),
            valid_B=jax.device_put(np.asarray(batch.valid_B, np.float32), self._replicated),
            group_ids_B=jax.device_put(np.asarray(batch.group_ids_B, np.int32), self._replicated),
            behaviour_current_UMC=jax.device_put(current_B.astype(np.float32).reshape(U, -1, C), self._rows_UMC),
        )
        self._state, outputs = self._step(self._state, inputs, self._ref_params)
        outputs = jax.device_get(outputs)
        elapsed = time.perf_counter() - start
        return self._finish(outputs, versions_B, elapsed, rows)

    def _arrived_rows(self, batch: TrainBatch) -> np.ndarray:
        """[B] bool: rows whose behaviour log-probs came with the batch, scored by their rollout slice
        (`trainer.behaviour_logps = "rollout"`) or sampled with them (every row under "sampler");
        none under "trainer", which recomputes every row."""
        known_B = np.zeros(batch.batch_size, bool)
        if self.config.behaviour_logps == "sampler":
            known_B[:] = True
        elif self.config.behaviour_logps == "rollout" and batch.behaviour_known_B is not None:
            known_B = np.asarray(batch.behaviour_known_B, bool)
        return known_B

    def _current_rows(self, versions_B: np.ndarray) -> np.ndarray:
        """[B] bool: rows whose behaviour log-probs the step's own forward gives (no recompute):
        generated by the current version and trained on by the first update, before the params
        move (`trainer.reuse_current_logps`)."""
        current_B = versions_B == self._version
        if not self.config.reuse_current_logps:
            return np.zeros_like(current_B)
        first_update = np.arange(versions_B.size) < versions_B.size // self.config.num_updates
        return current_B & first_update

    # ------------------------------------------------- ahead-of-time compilation
    def lower_train_step(self, batch_size: int, length: int) -> jax.stages.Lowered:
        """The whole-batch step (`trainer.length_bucket` = 0) lowered for `batch_size` rows of
        `length` positions, on this trainer's state (abstract or real: nothing runs)."""
        U, C = self.config.num_updates, self.config.micro_batch_size
        rows = lambda dtype: jax.ShapeDtypeStruct(  # noqa: E731
            (U, batch_size // (U * C), C, length), dtype, sharding=self._rows_UMCT
        )
        flat = lambda dtype: jax.ShapeDtypeStruct((batch_size,), dtype, sharding=self._replicated)  # noqa: E731
        inputs = StepInputs(
            tokens_UMCT=rows(np.int32),
            loss_mask_UMCT=rows(np.float32),
            inference_logps_UMCT=rows(np.float32),
            behaviour_logps_UMCT=rows(np.float32),
            behaviour_current_UMC=jax.ShapeDtypeStruct(
                (U, batch_size // (U * C), C), np.float32, sharding=self._rows_UMC
            ),
            rewards_B=flat(np.float32),
            valid_B=flat(np.float32),
            group_ids_B=flat(np.int32),
        )
        return self._step.lower(self._state, inputs, self._ref_params)

    def lower_recompute(self, batch_size: int, length: int) -> jax.stages.Lowered:
        """The behaviour log-prob chunk program for a whole-batch step's [U, M, C, T] buffers."""
        U, C = self.config.num_updates, self.config.micro_batch_size
        tokens = jax.ShapeDtypeStruct((U, batch_size // (U * C), C, length), np.int32, sharding=self._rows_UMCT)
        return self._behaviour.lower(self._state.params, tokens)

    def lower_bucketed(self, batch_size: int, max_length: int, widths=(None,)) -> list[tuple[str, jax.stages.Lowered]]:
        """With `length_bucket`, every program `warmup` compiles (gradient and, unless
        `behaviour_logps = "sampler"`, recompute per bucket,
        the gradient sum, the optimizer update), lowered; [] without."""
        if self._bucketed is None:
            return []
        rows_per_update = batch_size // self.config.num_updates
        return self._bucketed.lower(self._state, self._ref_params, max_length, rows_per_update, widths)

    # -------------------------------------------------------------- internals
    def _rows(self, x_BT: np.ndarray, dtype) -> jax.Array:
        """A host [B, T] array laid out [U, M, C, T] on the trainer mesh."""
        U, C = self.config.num_updates, self.config.micro_batch_size
        x_BT = np.asarray(x_BT, dtype)
        return jax.device_put(x_BT.reshape(U, -1, C, x_BT.shape[-1]), self._rows_UMCT)

    def _params_of(self, version: int):
        """The params of `version` for the behaviour recompute; notes their digest for the ledger."""
        if version == self._version:
            params = self.served_params()
        elif self._store is None:
            raise ValueError(
                f"batch holds version {version} but the trainer (version {self._version}) has no ParamStore"
            )
        else:
            params = self._store.get(version, self.param_shardings, copy=False)  # recompute never donates params
        if version not in self._digests:
            self._digests = {v: d for v, d in self._digests.items() if v > self._version - 64}
            self._digests[version] = params_digest(params)
        self._used_digests[version] = self._digests[version]
        return params

    def _check_batch(self, batch: TrainBatch, versions_B: np.ndarray) -> None:
        B, chunk = batch.batch_size, self.config.num_updates * self.config.micro_batch_size
        if B % chunk:
            raise ValueError(
                f"batch of {B} samples does not split into trainer.num_updates={self.config.num_updates} "
                f"x trainer.micro_batch_size={self.config.micro_batch_size} x micro-batches"
            )
        if versions_B.size and versions_B.max() > self._version:
            raise ValueError(
                f"batch holds version {versions_B.max()}, newer than the trainer's version {self._version}"
            )

    def _finish(self, outputs, versions_B: np.ndarray, elapsed: float, rows: tuple[int, int, int]) -> StepMetrics:
        """`rows`: (recomputed here, arrived with the batch, computed ahead) behaviour log-prob rows;
        the arrived ones were scored by the rollout, or sampled with them under "sampler"."""
        finite_U = np.asarray(outputs.finite_U)
        lr = float(self._schedule(max(int(outputs.updates) - 1, 0)))
        for ok in finite_U:
            self._nonfinite_in_a_row = 0 if ok else self._nonfinite_in_a_row + 1
        if self._nonfinite_in_a_row >= self.config.max_nonfinite_in_a_row:
            raise FloatingPointError(
                f"{self._nonfinite_in_a_row} optimizer updates in a row had a non-finite loss or gradient "
                f"(trainer.max_nonfinite_in_a_row={self.config.max_nonfinite_in_a_row}); last loss "
                f"{float(outputs.loss)}, grad norm {float(outputs.grad_norm)}, at version {self._version}"
            )
        staleness = collections.Counter((self._version - versions_B).tolist())
        self._version += 1
        stats: LossStats = outputs.stats
        tokens = int(stats.tokens)
        return StepMetrics(
            version=self._version,
            loss=float(outputs.loss),
            grad_norm=float(outputs.grad_norm),
            lr=lr,
            skipped_updates=int((finite_U == 0).sum()),
            nonfinite_in_a_row=self._nonfinite_in_a_row,
            dropped_groups=int(outputs.dropped_groups),
            loss_tokens=tokens,
            tokens_per_s=tokens / max(elapsed, 1e-9),
            step_time_s=elapsed,
            staleness={int(k): int(v) for k, v in sorted(staleness.items())},
            recomputed_rows=rows[0],
            rollout_scored_rows=rows[1] if self.config.behaviour_logps != "sampler" else 0,
            sampler_rows=rows[1] if self.config.behaviour_logps == "sampler" else 0,
            ahead_rows=rows[2],
            behaviour_digests=dict(sorted(self._used_digests.items())),
            **stats.summary(),
            **_router_metrics(outputs),
        )


def _router_metrics(outputs) -> dict:
    """StepMetrics' MoE fields from the step outputs (none for a dense model)."""
    load_LX = np.asarray(outputs.router_load_LX)
    if load_LX.size == 0:
        return {}
    counts_LX = np.rint(load_LX).astype(np.int64)  # exact integer counts, summed in float32 on device
    ratio_L = counts_LX.max(-1) / np.maximum(counts_LX.mean(-1), 1e-9)
    return dict(
        expert_load=tuple(tuple(int(n) for n in row) for row in counts_LX),
        router_load_ratio=tuple(float(r) for r in ratio_L),
        router_aux_loss=float(outputs.router_aux_loss),
    )


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves carrying `shardings` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
