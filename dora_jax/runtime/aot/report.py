"""compile.json's result, the roles that do not fit (and what would), and the table `tpu_compile` prints."""

from __future__ import annotations

from dora_jax.runtime.aot.costs import transient_bytes
from dora_jax.runtime.aot.topology import GiB


def result_of(records: list[dict]) -> dict:
    """compile.json's content (without "config") for these role records; "fits" None when some
    programs were left out (`--programs`: nothing is known of their memory) and no role is known
    not to fit."""
    fits = all(r["fits"] is not False for r in records)
    if fits and any("programs_selected" in r for r in records):
        return {"roles": records, "fits": None}
    return {"roles": records, "fits": fits}


def unknown_programs(result: dict, names) -> str | None:
    """What is wrong with `--programs=names` when some name is no program of the roles compiled
    (a typo compiles nothing and would pass for a success); None when every name is one."""
    known = {name for role in result["roles"] for name in role.get("program_names", ())}
    unknown = sorted(set(names) - known)
    if not unknown:
        return None
    return f"--programs: {', '.join(unknown)} is no program of the roles compiled; they have {', '.join(sorted(known))}"


def does_not_fit(result: dict) -> list[str]:
    """One line per role that does not fit: the program, its bytes and the capacity."""
    lines = []
    for role in result["roles"]:
        if role["fits"] is not False:
            continue
        failed = [p["name"] for p in role["programs"] if "error" in p]
        if failed:
            lines.append(f"{role['role']} on {role['topology']}: {', '.join(failed)} did not compile")
        largest = next((p for p in role["programs"] if p["name"] == role["largest_program"]), None)
        if role["peak_bytes_per_chip"] > role["hbm_capacity_bytes_per_chip"] and largest is not None:
            gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
            lines.append(
                f"{role['role']} on {role['topology']} does not fit: {largest['name']} needs "
                f"{gib(transient_bytes(largest))} per chip on top of {gib(role['resident_bytes_per_chip'])} "
                f"resident = {gib(role['peak_bytes_per_chip'])} > {gib(role['hbm_capacity_bytes_per_chip'])} HBM; "
                + _what_would_fit(role, largest)
            )
    return lines


def _what_would_fit(role: dict, largest: dict) -> str:
    """Which config fields to change, and by about how much, for `role` to fit its HBM."""
    capacity, resident = role["hbm_capacity_bytes_per_chip"], role["resident_bytes_per_chip"]
    mesh_field = f"mesh.{role['role']}"
    more_chips = f"more chips (pod.{role['role']}_type, {mesh_field})"
    if resident >= capacity:
        return f"the resident state alone is {resident / GiB:.2f} GiB: {more_chips}"
    room = capacity - resident
    if role["role"] == "rollout":
        kv = role["resident_breakdown"].get("decode_state", 0)
        fixed = resident - kv + transient_bytes(largest)
        if kv and fixed < capacity:
            share = (capacity - fixed) / kv
            return (
                f"the KV cache (rollout.slots x rollout.cache_length) takes {kv / GiB:.2f} GiB: about "
                f"{share:.2f}x of it would fit, or {more_chips}"
            )
        return f"{more_chips}, or a smaller rollout.max_prefill_length"
    share = room / transient_bytes(largest)
    return (
        f"its temporaries scale with the micro-batch (trainer.micro_batch_tokens, trainer.micro_batch_size): "
        f"about {share:.2f}x of it would fit, or {more_chips}, or model.remat='full'"
    )


def table(result: dict) -> str:
    """The roles and their programs as text."""
    gib = lambda n: "-" if n is None else f"{n / GiB:.2f}"  # noqa: E731
    lines = [f"{'role':8} {'topology':12} {'chips':>5} {'resident GiB':>12} {'peak GiB':>9} {'HBM GiB':>8}  fits"]
    for r in result["roles"]:
        lines.append(
            f"{r['role']:8} {r['topology']:12} {r['chips']:>5} {gib(r['resident_bytes_per_chip']):>12} "
            f"{gib(r['peak_bytes_per_chip']):>9} {gib(r['hbm_capacity_bytes_per_chip']):>8}  {r['fits']}"
        )
    lines.append("")
    lines.append(
        f"{'program':52} {'temp GiB':>9} {'args GiB':>9} {'TFLOP':>9} {'est ms':>9} {'floor ms':>15}  estimate"
    )
    for r in result["roles"]:
        for p in r["programs"]:
            if "error" in p:
                lines.append(f"{r['role'] + ' ' + p['name']:52} {p['error']}")
                continue
            ms = "-" if p["estimated_s"] is None else f"{p['estimated_s'] * 1e3:.2f}"
            name = f"{r['role']} {p['name']}"
            tflop = "-" if p["flops"] is None else f"{p['flops'] / 1e12:.3f}"
            floor = "-" if "floor" not in p else f"{p[p['floor'] + '_floor_s'] * 1e3:.2f} {p['floor']}"
            lines.append(
                f"{name:52} {gib(p['temp_bytes']):>9} {gib(p['argument_bytes']):>9} {tflop:>9} "
                f"{ms:>9} {floor:>15}  {p['estimate']}" + (f" (MFU {p['mfu']:.1%})" if "mfu" in p else "")
            )
    return "\n".join(lines)
