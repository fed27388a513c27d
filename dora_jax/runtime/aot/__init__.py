"""Ahead-of-time compilation of every program a role runs, for a TPU topology, on a CPU machine.

With `libtpu` installed and `JAX_PLATFORMS=cpu`, `jax.experimental.topologies.get_topology_desc`
hands out the devices of a TPU slice that is not here (`v5p:2x2x4` is a v5p-32), and lowering a
jitted function on `ShapeDtypeStruct`s sharded over a mesh of those devices runs the real TPU
compiler. Its `memory_analysis()` and `cost_analysis()` describe each program on one chip.

`compile_roles(config, pod, target)` builds each role's mesh on its topology (`mesh.trainer` on
the trainer slice, `mesh.rollout` on one rollout slice; a single host splits its chips as the
embedded run does), the params abstractly (`jax.eval_shape` of the model init: no weights in
memory), the Trainer and the RolloutEngine over them (`Trainer.abstract`,
`RolloutEngine.lower_programs`), and compiles: the train step (each bucket length with
`trainer.length_bucket`, else the widest batch), the behaviour recompute, the optimizer update
(inside the whole-batch step, or alone when bucketed); prefill per bucket, generate, insert and
slot export per row bucket (an import is an insert).

Memory per chip: resident = what stays between programs (trainer: params, optimizer state, the
KL reference, the param versions the ParamStore keeps for recompute: K + 1 copies on device in
one process, one at a time read from a tensorstore tier in a multi-slice pod; rollout: params and
the decode state with its KV cache); peak = resident + the largest program's transient bytes
(temporaries plus outputs that alias no input). Time per program: XLA's `optimal_seconds` where
positive, else a roofline max(flops / peak FLOP/s, bytes / HBM bandwidth) marked "roofline".
XLA counts a `lax.scan` body once, so the whole-batch train step is compiled with one micro-batch
per update (M = 1: the same micro-batch program, temporaries and gradient accumulator; inputs M
times smaller) and its flops, bytes and time are XLA's figures times the U x M micro-batch trips
(the optimizer update, U times in truth, is then counted U x M times: small next to a
micro-batch's forward and backward). With `model.scan_layers` the blocks are one scan too: such a
program is compiled whole for its memory, and its cost comes from two probe compiles with the
blocks unrolled (1 and 2 blocks, the vocabulary in one pass, no windowed einsum: nothing XLA
would count once), extrapolated to L blocks; only the widths in `estimate_lengths` get probes.
The splash attention kernel is opaque to XLA's cost model: its flops are added at the chip's peak
(the megablox expert kernels carry cost estimates, which XLA counts). `flops_due` is what the
matmuls must compute, beside XLA's own count.
"""

# The package's parts, by what they hold; callers import
# what they use from here (`from dora_jax.runtime import aot`), as from the single module it was.
import importlib.util  # noqa: F401  (aot.importlib.util.find_spec: where libtpu is looked for)

from dora_jax.rollout.engine import RolloutEngine  # noqa: F401  (as the single module exposed it)
from dora_jax.runtime.aot.compile import (  # noqa: F401
    PROBE_OPTIONS,
    _abstract_trainer,
    compile_program,
    compile_role,
    compile_roles,
    kv_capacity,
    migration_rule,
    probe_costs,
    read_probe_costs,
    trainer_programs,
    write_probe_costs,
)
from dora_jax.runtime.aot.costs import (  # noqa: F401
    KNOWN_ARCHITECTURES,
    Program,
    _estimate,
    attention_kernel_flops,
    bytes_per_chip,
    hardware_flops,
    matmul_params,
    mfu_of,
    model_config,
    rollout_program,
    train_model_flops,
    transient_bytes,
    weight_bytes,
)
from dora_jax.runtime.aot.report import (  # noqa: F401
    does_not_fit,
    result_of,
    table,
    unknown_programs,
)
from dora_jax.runtime.aot.topology import (  # noqa: F401
    CHIPS,
    INSTALL,
    Chip,
    GiB,
    RoleTarget,
    chip_of_topology,
    plan_roles,
    topology_devices,
    topology_of_type,
)
