"""Small clusters and workloads shared by the simulator tests."""

from dora_jax.sim import ClusterSpec, DecodeModel, Placement, WorkloadSpec


def tiny_cluster(
    groups=2,
    slots=4,
    placement=Placement.SPLIT,
    t0=1.0,
    t1=0.0,
    train_fixed_s=5.0,
    train_s_per_token=0.0,
    prefill=0.0,
    weight_load=0.0,
    kv_bytes=0.0,
) -> ClusterSpec:
    return ClusterSpec(
        num_groups=groups,
        slots_per_group=slots,
        accelerators_per_group=1,
        decode=DecodeModel(t0, t1),
        prefill_s_per_token=prefill,
        weight_load_s=weight_load,
        kv_bytes_per_token=kv_bytes,
        migrate_bytes_per_s=1e9,
        train_accelerators=1,
        train_s_per_token=train_s_per_token,
        train_fixed_s=train_fixed_s,
        placement=placement,
    )


def long_tail_workload(prompts=16, g=4, seed=0) -> WorkloadSpec:
    return WorkloadSpec(
        prompts_per_step=prompts,
        samples_per_prompt=g,
        prompt_tokens=64,
        median_response=60.0,
        max_response=1500,
        max_over_median=12.0,
        seed=seed,
    )
