"""policy_loss / token_weights / token_logps against an independent NumPy reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.trainer.loss import LOSS_NORMS, LossConfig, policy_loss, token_logps, token_weights

EPS_LOW, EPS_HIGH, DUAL = 0.2, 0.28, 3.0
# Ratios chosen to land in every branch: below 1-eps_low, inside, above 1+eps_high, above c.
RATIOS = (0.5, 0.9, 1.0, 1.1, 1.5, 5.0)


def reference_loss(logp, beh, inf, adv, loss_mask, valid, cfg: LossConfig, ref=None):
    """Token by token, case by case (no max/clip formula), then the normalisation by its definition."""
    B, T = logp.shape
    m = loss_mask * valid[:, None]
    per_token = np.zeros((B, T))
    counts = dict(low=0, high=0, dual=0)
    for b in range(B):
        for t in range(T):
            if m[b, t] == 0:
                continue
            r, A = math.exp(logp[b, t] - beh[b, t]), adv[b]
            if A > 0:
                loss = -A * min(r, 1 + cfg.eps_high)
                counts["high"] += r > 1 + cfg.eps_high
            elif A < 0:
                bounded = max(r, 1 - cfg.eps_low)
                counts["low"] += r < 1 - cfg.eps_low
                if cfg.dual_clip is not None:
                    bounded = min(bounded, cfg.dual_clip)
                    counts["dual"] += r > cfg.dual_clip
                loss = -A * bounded
            else:
                loss = 0.0
            if cfg.tis_cap is not None:
                loss *= min(math.exp(beh[b, t] - inf[b, t]), cfg.tis_cap)
            if cfg.kl_coef:
                d = min(max(ref[b, t] - logp[b, t], -20.0), 20.0)
                loss += cfg.kl_coef * min(max(math.exp(d) - d - 1, -10.0), 10.0)
            per_token[b, t] = loss
    if cfg.loss_norm == "token_mean":
        total = per_token.sum() / m.sum()
    elif cfg.loss_norm == "seq_mean_token_mean":
        seqs = [per_token[b].sum() / m[b].sum() for b in range(B) if m[b].sum() > 0]
        total = sum(seqs) / len(seqs)
    else:
        total = per_token.sum() / (B * cfg.t_max)
    return total, counts


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    B, T = 6, 12
    logp = rng.uniform(-3, -0.1, (B, T))
    ratio = np.asarray(RATIOS)[rng.integers(0, len(RATIOS), (B, T))]
    beh = logp - np.log(ratio)
    inf = beh + rng.normal(0, 0.3, (B, T))
    ref = logp + rng.normal(0, 0.2, (B, T))
    adv = np.array([1.0, -1.0, 0.7, -0.4, 0.0, 2.0])
    loss_mask = np.zeros((B, T))
    for b, (start, stop) in enumerate([(2, 12), (3, 9), (1, 12), (4, 11), (2, 6), (5, 12)]):
        loss_mask[b, start:stop] = 1
    valid = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # the last sample is masked out
    # Garbage on the masked sample and off the loss mask: must not leak anywhere.
    inf[5] = np.nan
    beh[5, :3] = np.inf
    inf[loss_mask == 0] = -np.inf
    return logp, beh, inf, adv, loss_mask, valid, ref


def run(inputs, cfg):
    logp, beh, inf, adv, loss_mask, valid, ref = inputs
    mask = jnp.asarray(loss_mask * valid[:, None], jnp.float32)
    weights = token_weights(mask, cfg.loss_norm, cfg.t_max)

    def loss_fn(logp_BT):
        return policy_loss(
            logp_BT,
            jnp.asarray(beh, jnp.float32),
            jnp.asarray(inf, jnp.float32),
            jnp.asarray(adv, jnp.float32),
            mask,
            weights,
            cfg,
            ref_logps_BT=jnp.asarray(ref, jnp.float32),
        )

    (loss, stats), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp, jnp.float32))
    return float(loss), jax.device_get(stats), np.asarray(grad)


CASES = [
    LossConfig(loss_norm=norm, tis_cap=tis, dual_clip=dual, kl_coef=kl, t_max=64)
    for norm in LOSS_NORMS
    for tis, dual, kl in [(None, DUAL, 0.0), (1.5, DUAL, 0.0), (None, None, 0.1), (0.8, DUAL, 0.05)]
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.loss_norm}-tis{c.tis_cap}-dual{c.dual_clip}-kl{c.kl_coef}")
def test_loss_matches_reference(inputs, cfg):
    logp, beh, inf, adv, loss_mask, valid, ref = inputs
    want, counts = reference_loss(logp, beh, inf, adv, loss_mask, valid, cfg, ref)
    loss, stats, grad = run(inputs, cfg)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-7)
    assert (int(stats.clip_low), int(stats.clip_high), int(stats.clip_dual)) == (
        counts["low"],
        counts["high"],
        counts["dual"],
    )
    assert counts["low"] > 0 and counts["high"] > 0 and (counts["dual"] > 0) == (cfg.dual_clip is not None)
    assert int(stats.tokens) == int((loss_mask * valid[:, None]).sum())
    assert np.isfinite(grad).all()
    assert (grad[loss_mask * valid[:, None] == 0] == 0).all()  # masked tokens get no gradient


def test_stats_summary_values(inputs):
    logp, beh, inf, adv, loss_mask, valid, ref = inputs
    cfg = LossConfig(tis_cap=1.5)
    _, stats, _ = run(inputs, cfg)
    on = (loss_mask * valid[:, None]) > 0
    ratio = np.exp(logp - beh)[on]
    tis = np.minimum(np.exp(beh - inf), 1.5)[on]
    summary = stats.summary()
    np.testing.assert_allclose(summary["ratio_mean"], ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose([summary["ratio_min"], summary["ratio_max"]], [ratio.min(), ratio.max()], rtol=1e-5)
    np.testing.assert_allclose([summary["tis_mean"], summary["tis_max"]], [tis.mean(), tis.max()], rtol=1e-5)


def test_masked_sample_contributes_nothing(inputs):
    """Whatever a masked sample holds, loss and gradients are those of the batch without it."""
    logp, beh, inf, adv, loss_mask, valid, ref = inputs
    kept = valid > 0
    for cfg in (LossConfig(loss_norm="seq_mean_token_mean", tis_cap=2.0, kl_coef=0.1), LossConfig(tis_cap=1.0)):
        loss_a, _, grad_a = run(inputs, cfg)
        logp2, beh2, adv2 = logp.copy(), beh.copy(), adv.copy()
        logp2[5], beh2[5], adv2[5] = -50.0, 40.0, -9.0
        loss_b, _, grad_b = run((logp2, beh2, inf, adv2, loss_mask, valid, ref), cfg)
        assert loss_a == loss_b
        np.testing.assert_array_equal(grad_a, grad_b)
        assert (grad_a[~kept] == 0).all()
        # The reference on the batch with the sample removed altogether.
        dropped = (logp[kept], beh[kept], inf[kept], adv[kept], loss_mask[kept], valid[kept], cfg, ref[kept])
        np.testing.assert_allclose(loss_a, reference_loss(*dropped)[0], rtol=2e-5)


def test_token_weights_modes():
    mask = jnp.asarray([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], jnp.float32)
    np.testing.assert_allclose(token_weights(mask, "token_mean", 8).sum(), 1.0)
    seq = np.asarray(token_weights(mask, "seq_mean_token_mean", 8))
    np.testing.assert_allclose(seq.sum(1), [0.5, 0.5, 0.0])
    np.testing.assert_allclose(np.asarray(token_weights(mask, "constant", 8)), np.asarray(mask) / 24)


def test_token_logps_and_entropy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, (2, 5))
    logps, entropy = token_logps(jnp.asarray(logits), jnp.asarray(tokens))
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.zeros((2, 5))
    want[:, 1:] = np.take_along_axis(logsm[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    want_h = np.zeros((2, 5))
    want_h[:, 1:] = -(np.exp(logsm) * logsm).sum(-1)[:, :-1]
    np.testing.assert_allclose(np.asarray(logps), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(entropy), want_h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])  # 20 s each
def test_vocab_chunked_logps_entropy_and_gradient_equal_unchunked(tied):
    """The sliced online softmax (V = 61, slices of 16 and a tail of 13) equals one log-softmax over
    the whole vocabulary: log-probs, entropy and the loss's gradient wrt every parameter."""
    from dora_jax.models import ModelConfig, init_model, split
    from dora_jax.trainer.step import sequence_logps

    cfg = ModelConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    graphdef, params = split(init_model(cfg, seed=3))
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 9)), jnp.float32)

    def loss(params, chunk):  # a logp term and an entropy term, so both gradients are checked
        logps, entropy = sequence_logps(graphdef, params, tokens, chunk)
        return jnp.sum(weights * logps) + 0.3 * jnp.sum(weights * entropy), (logps, entropy)

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (want, (want_logps, want_h)), want_grads = value_and_grad(params, 0)
    for chunk in (16, 7, 60):
        (got, (logps, h)), grads = value_and_grad(params, chunk)
        np.testing.assert_allclose(np.asarray(logps), np.asarray(want_logps), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_vocab_chunked_pass_never_holds_a_whole_vocab_array():
    """Compiled, the chunked gradient's temporaries stay far below one [B, T, V] float32 array."""
    from dora_jax.trainer.loss import hidden_token_logps

    B, T, E, V = 2, 256, 16, 8192
    rng = np.random.default_rng(5)
    head_EV = jnp.asarray(rng.normal(size=(E, V)) * 0.1, jnp.float32)
    x_BTE = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)

    def temp_bytes(chunk):
        def loss(head_EV, x_BTE):
            def unembed(x, start=0, size=None):
                head = head_EV if size is None else jax.lax.dynamic_slice_in_dim(head_EV, start, size, 1)
                return jnp.einsum("bte,ev->btv", x, head)

            logps, entropy = hidden_token_logps(unembed, x_BTE, tokens, V, chunk)
            return logps.sum() + entropy.sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return grad.lower(head_EV, x_BTE).compile().memory_analysis().temp_size_in_bytes

    whole_BTV = B * T * V * 4
    assert temp_bytes(0) >= whole_BTV
    assert temp_bytes(512) < whole_BTV / 4


def test_bad_config_errors():
    with pytest.raises(ValueError, match=r"loss_norm='sum'; expected one of"):
        LossConfig(loss_norm="sum")
    with pytest.raises(ValueError, match=r"dual_clip=1.1; expected None or > 1 \+ eps_high"):
        LossConfig(dual_clip=1.1)
    with pytest.raises(ValueError, match=r"tis_cap=0"):
        LossConfig(tis_cap=0)
    with pytest.raises(ValueError, match=r"vocab_chunk=-1; expected 0 \(off\)"):
        LossConfig(vocab_chunk=-1)
    with pytest.raises(ValueError, match=r"temperature=0.0; expected > 0"):
        LossConfig(temperature=0.0)


def test_k3_is_clamped_as_verls_low_var_kl():
    """k3 = clip(exp(d) - d - 1, -10, 10), d = clip(ref - logp, -20, 20) (verl's low_var_kl): golden
    values, and no KL gradient on a clipped token."""
    d = np.array([[0.0, -25.0, -3.0, 0.5, 2.0, 2.5, 3.0, 12.0, 25.0]])
    logp = np.full(d.shape, -1.0)
    ref = logp + d
    golden = [0.0, 10.0, math.exp(-3) + 2, math.exp(0.5) - 1.5, math.exp(2) - 3, math.exp(2.5) - 3.5, 10.0, 10.0, 10.0]
    np.testing.assert_allclose(golden[2:6], [2.049787068, 0.148721271, 4.389056099, 8.682493961], rtol=1e-8)
    mask = np.ones(d.shape)
    mask[:, 0] = 0  # position 0 is never in the loss
    cfg = LossConfig(kl_coef=0.5, loss_norm="constant", t_max=1)
    zeros = np.zeros(d.shape, np.float32)

    def loss_fn(logp_BT):
        return policy_loss(
            logp_BT, logp_BT, logp_BT, jnp.zeros(1), jnp.asarray(mask, jnp.float32),
            token_weights(jnp.asarray(mask, jnp.float32), "constant", 1), cfg,
            ref_logps_BT=jnp.asarray(ref, jnp.float32), entropy_BT=jnp.asarray(zeros),
        )  # fmt: skip

    (loss, stats), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp, jnp.float32))
    k3 = np.asarray(golden)[1:]
    np.testing.assert_allclose(float(stats.kl_sum), k3.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.5 * k3.sum(), rtol=1e-5)  # weights m / (B * t_max) = m
    # d/dlogp k3 = 1 - exp(d) inside the clips (A = 0: the policy term has no gradient), 0 where clipped.
    want_grad = np.where(np.abs(np.exp(d) - d - 1) < 10, 1 - np.exp(np.clip(d, -20, 20)), 0.0) * mask * 0.5
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)


def _log_softmax_at(logits, temperature):
    z = logits.astype(np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_token_logps_at_a_temperature_equal_numpy_log_softmax_of_logits_over_t():
    rng = np.random.default_rng(2)
    logits = 3 * rng.normal(size=(2, 6, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (2, 6))
    logsm = _log_softmax_at(logits[:, :-1], 0.7)
    want = np.zeros((2, 6))
    want[:, 1:] = np.take_along_axis(logsm, tokens[:, 1:, None], -1)[..., 0]
    want_h = np.zeros((2, 6))
    want_h[:, 1:] = -(np.exp(logsm) * logsm).sum(-1)
    logps, entropy = token_logps(jnp.asarray(logits), jnp.asarray(tokens), 0.7)
    np.testing.assert_allclose(np.asarray(logps), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), want_h, rtol=1e-5, atol=1e-5)
    plain = np.asarray(token_logps(jnp.asarray(logits), jnp.asarray(tokens))[0])
    assert np.abs(plain - want).max() > 0.1  # T = 1 is another distribution


@pytest.mark.parametrize("chunk", [0, 4, 5])
def test_vocab_chunked_logps_at_a_temperature(chunk):
    """The sliced pass (slices of 4 or 5 over V = 11, with a tail) at T = 0.7 equals the numpy
    log_softmax(logits / T) and its entropy."""
    from dora_jax.trainer.loss import hidden_token_logps

    rng = np.random.default_rng(6)
    B, T, E, V = 2, 7, 5, 11
    head_EV = rng.normal(size=(E, V)).astype(np.float32)
    x_BTE = rng.normal(size=(B, T, E)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T))

    def unembed(x, start=0, size=None):
        head = head_EV if size is None else jax.lax.dynamic_slice_in_dim(jnp.asarray(head_EV), start, size, 1)
        return jnp.einsum("bte,ev->btv", x, head)

    logps, entropy = jax.jit(lambda x, t: hidden_token_logps(unembed, x, t, V, chunk, temperature=0.7))(
        jnp.asarray(x_BTE), jnp.asarray(tokens)
    )
    logsm = _log_softmax_at(np.einsum("bte,ev->btv", x_BTE, head_EV)[:, :-1], 0.7)
    want = np.zeros((B, T))
    want[:, 1:] = np.take_along_axis(logsm, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logps), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[:, 1:], -(np.exp(logsm) * logsm).sum(-1), rtol=1e-5, atol=1e-5)
