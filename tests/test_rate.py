"""apr.rate.RateMeter: tok/s and ETA that do not jump with every hiccup (issue 24 item 8)."""

from apr.rate import RateMeter


def test_a_steady_rate_is_reported_exactly():
    m = RateMeter()
    for i in range(10):
        m.update(i * 100, i * 1.0)
    assert abs(m.rate - 100.0) < 1e-9
    assert abs(m.eta(1000) - 10.0) < 1e-9


def test_one_slow_interval_moves_the_estimate_a_little_not_all_the_way():
    # 12.4k tok/s, then one 1-second interval at 379 tok/s (another process took the CPU).
    m = RateMeter(time_constant_s=20.0)
    t, done = 0.0, 0
    m.update(done, t)
    for _ in range(20):
        t, done = t + 0.5, done + 6200
        m.update(done, t)
    before = m.rate
    t, done = t + 1.0, done + 379
    after = m.update(done, t)
    assert abs(before - 12_400) < 1
    assert after > 0.9 * before  # a per-interval rate would have shown 379
    eta_before, eta_after = 600_000 / before, m.eta(600_000)
    assert eta_after < 1.15 * eta_before  # the ETA does not jump from ~48 s to 26 min


def test_no_rate_before_two_readings_and_no_eta_without_a_rate():
    m = RateMeter()
    assert m.update(0, 0.0) is None and m.eta(10) is None
    assert m.update(0, 1.0) is None  # nothing done yet: the stall counts in the next interval
    assert m.update(5, 2.0) == 2.5
