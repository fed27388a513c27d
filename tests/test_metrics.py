"""The metrics writer's rows and the reward-curve plot drawn from them."""

from dora_jax.runtime.metrics import MetricsWriter, plot_reward_curve, read_metrics


def test_reward_curve_png_from_metrics(tmp_path):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    for step, reward in enumerate([0.1, 0.2, float("nan"), 0.4]):
        writer.write(step, {"reward_mean": reward, "loss": 0.5})
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["reward_mean"] for r in rows] == [0.1, 0.2, None, 0.4]  # non-finite -> null
    path = plot_reward_curve(str(tmp_path))
    assert path == str(tmp_path / "reward_curve.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_rewards_no_plot(tmp_path):
    MetricsWriter(str(tmp_path), tensorboard=False).close()
    assert plot_reward_curve(str(tmp_path)) is None
