"""RewardPool: values, and every way a reward function can fail without taking the pool down."""

import threading
import time

import pytest

from dora_jax.tasks import math_answers
from dora_jax.tasks.prompt import Prompt
from dora_jax.tasks.reward_pool import InlineRewardPool, RewardPool, RewardResult
from tests.tasks import reward_fns


def test_scores_in_order():
    with RewardPool(reward_fns.add, num_workers=2, timeout_s=5.0) as pool:
        results = pool.score_many([(i, 1) for i in range(20)])
    assert [r.value for r in results] == [float(i + 1) for i in range(20)]
    assert all(r.ok for r in results)
    assert [r.key for r in results] == [str(i) for i in range(20)]


def test_failures_become_masked_results_and_the_pool_keeps_working():
    with RewardPool(reward_fns.identity, num_workers=1, timeout_s=5.0) as pool:
        results = pool.score_many([("a",), (float("nan"),), (None,), (float("inf"),), (0.5,), (True,)])
    errors = [r.error for r in results]
    assert "returned str 'a', not a number" in errors[0]
    assert "non-finite nan" in errors[1]
    assert "NoneType" in errors[2]
    assert "non-finite inf" in errors[3]
    assert [r.value for r in results] == [0.0, 0.0, 0.0, 0.0, 0.5, 1.0]
    assert errors[4] is None and errors[5] is None


def test_exception_is_reported():
    with RewardPool(reward_fns.raise_value_error, num_workers=1, timeout_s=5.0) as pool:
        result = pool.submit("k", ("bad gold answer",)).result()
    assert result == RewardResult(0.0, "ValueError: bad gold answer", "k", result.elapsed_s)


def test_timeout_kills_the_worker_and_a_new_one_takes_over():
    with RewardPool(reward_fns.sleep_then, num_workers=1, timeout_s=0.5) as pool:
        start = time.monotonic()
        hung = pool.submit("hung", (60.0, 1.0))
        after = [pool.submit(f"ok{i}", (0.0, float(i))) for i in range(3)]
        result = hung.result(timeout=10)
        assert result.error == "timeout after 0.5s" and result.value == 0.0
        assert [f.result(timeout=10).value for f in after] == [0.0, 1.0, 2.0]
        assert time.monotonic() - start < 5
        assert pool.worker_restarts == 1


def test_worker_crash_fails_only_its_sample():
    with RewardPool(reward_fns.exit_process, num_workers=2, timeout_s=5.0) as crashing:
        result = crashing.submit("crash", (3,)).result(timeout=10)
    assert result.value == 0.0 and result.error == "reward worker died (exit code 3)"
    with RewardPool(reward_fns.pid, num_workers=1, timeout_s=5.0) as pool:
        first = pool.submit("a", (0,)).result(timeout=10).value
        assert pool.submit("b", (0,)).result(timeout=10).value == first  # the same worker serves


def test_crash_among_good_samples():
    items = [(0.0, 1.0), (0.0, 2.0), (0.0, 3.0)]
    with RewardPool(reward_fns.sleep_then, num_workers=2, timeout_s=5.0) as pool:
        assert [r.value for r in pool.score_many(items)] == [1.0, 2.0, 3.0]
        bad = pool.submit("bad", ("not a number", 1.0)).result(timeout=10)
        assert bad.error.startswith("TypeError")
        assert [r.value for r in pool.score_many(items)] == [1.0, 2.0, 3.0]


def test_submit_from_many_threads():
    with RewardPool(reward_fns.add, num_workers=2, timeout_s=5.0) as pool:
        futures = {}

        def submit(offset):
            for i in range(25):
                futures[offset + i] = pool.submit(str(offset + i), (offset + i, 0))

        threads = [threading.Thread(target=submit, args=(100 * t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(f.result(timeout=20).value == float(k) for k, f in futures.items())
        assert len(futures) == 100


def test_unpicklable_function_and_arguments():
    with pytest.raises(ValueError, match="top-level"):
        RewardPool(lambda prompt, text: 1.0, num_workers=1)
    with RewardPool(reward_fns.identity, num_workers=1, timeout_s=5.0) as pool:
        result = pool.submit("k", (threading.Lock(),)).result(timeout=10)
    assert result.value == 0.0 and "not picklable" in result.error


def test_a_worker_that_cannot_start_breaks_the_pool_with_a_clear_error():
    pool = RewardPool(reward_fns.add, num_workers=1, timeout_s=5.0, preload=("no_such_module_xyz",))
    try:
        result = pool.submit("k", (1, 2)).result(timeout=30)
        assert result.value == 0.0 and "no_such_module_xyz" in result.error
        with pytest.raises(RuntimeError, match="broken.*no_such_module_xyz"):
            pool.submit("k2", (1, 2))
    finally:
        pool.close()


def test_close_fails_pending_samples():
    pool = RewardPool(reward_fns.sleep_then, num_workers=1, timeout_s=30.0)
    futures = [pool.submit(str(i), (10.0, 1.0)) for i in range(3)]
    time.sleep(0.5)
    pool.close()
    assert [f.result(timeout=5).error for f in futures] == ["reward pool closed"] * 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("late", (0.0, 1.0))


def test_real_rewards_through_the_pool():
    prompt = Prompt("gsm8k:0", "question", (1,), "#### 72")
    with RewardPool(math_answers.numeric_reward, num_workers=1, timeout_s=5.0) as pool:
        results = pool.score_many(
            [(prompt, "so \\boxed{72}"), (prompt, "so \\boxed{71}"), (Prompt("x", "q", (), "none"), "1")]
        )
    assert [r.value for r in results] == [1.0, 0.0, 0.0]
    assert results[2].error.startswith("ValueError: prompt 'x': no number")
    import math_verify  # noqa: F401  (a core dependency: the test must run)

    with RewardPool(math_answers.math_verify_reward, 1, 30.0, preload=("math_verify",)) as pool:
        results = pool.score_many([(Prompt("m", "q", (), "\\frac{1}{2}"), "$\\boxed{0.5}$")])
    assert results[0].value == 1.0, results


def test_inline_pool_has_the_same_contract():
    pool = InlineRewardPool(reward_fns.identity)
    results = pool.score_many([(1.0,), ("x",)])
    assert results[0].value == 1.0 and results[0].ok
    assert results[1].value == 0.0 and "not a number" in results[1].error
    assert "ValueError: no" in InlineRewardPool(reward_fns.raise_value_error).submit("k", ("no",)).result().error
