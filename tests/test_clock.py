"""The fleet's clock: Redis's TIME carried forward on the host's monotonic clock."""

from __future__ import annotations

from tokenfleet.shared.redis.clock import FleetClock


class FakeTime:
    """A Redis whose clock is ``redis_s``, and this host's monotonic clock; the
    request of a TIME takes ``there_s`` to reach it and the reply ``back_s``."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.redis_s = 5_000.0
        self.there_s = self.back_s = 0.001
        self.calls = 0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> tuple[int, int]:
        self.calls += 1
        self.advance(self.there_s)
        reply = (int(self.redis_s), round((self.redis_s % 1) * 1e6))
        self.advance(self.back_s)
        return reply

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.redis_s += seconds


def test_the_time_is_redis_s_whatever_this_host_s_wall_clock_says() -> None:
    fake = FakeTime()
    clock = FleetClock(monotonic=fake.monotonic, fallback=lambda: 60.0)
    clock.sync(fake)
    # Never ahead of Redis's clock, behind it by the reply's way back at most.
    assert 0 <= fake.redis_s - clock.now() <= fake.back_s + 1e-6
    fake.advance(12.5)
    assert 0 <= fake.redis_s - clock.now() <= fake.back_s + 1e-6


def test_redis_is_asked_again_only_once_the_reading_is_stale() -> None:
    fake = FakeTime()
    clock = FleetClock(max_age_s=30.0, monotonic=fake.monotonic)
    clock.read(fake)
    fake.advance(29.0)
    clock.read(fake)
    assert fake.calls == 1
    fake.advance(1.0)
    clock.read(fake)
    assert fake.calls == 2


def test_one_slow_reply_does_not_hold_the_clock_back_by_its_round_trip() -> None:
    fake = FakeTime()
    clock = FleetClock(max_age_s=30.0, monotonic=fake.monotonic)
    clock.sync(fake)
    fake.there_s, fake.back_s = 0.0, 0.400  # a reply held up 0.4 s on its way back
    clock.sync(fake)
    assert 0 <= fake.redis_s - clock.now() < 0.01
    fake.advance(30.0)  # stale: a reading behind by its round trip beats an old one
    clock.sync(fake)
    assert 0 <= fake.redis_s - clock.now() <= 0.4 + 1e-6


def test_before_its_first_reading_the_clock_is_the_fallback() -> None:
    clock = FleetClock(fallback=lambda: 42.0)
    assert clock.due and clock.now() == 42.0
