"""Which batch-level jobs a worker hands back when live jobs wait, and when it
hands back none (the worker's loop calls this between steps)."""

from __future__ import annotations

from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.preemption import Preemption, choose_victims
from tokenfleet.workers.sequence import Sequence


def seq(job_id: str, level: str, arrived_at: float) -> Sequence:
    """A job from the stream of ``level`` (a level's queue name: ``default:batch``)."""
    return Sequence(job_id, [1, 2, 3], SamplingParams(max_new_tokens=4), TextStream(None),
                    queue=level, arrived_at=arrived_at)


def batch(n: int, tenant: str = "") -> list[Sequence]:
    level = "default:batch" + (f":{tenant}" if tenant else "")
    return [seq(f"b{i}{tenant}", level, arrived_at=float(i)) for i in range(n)]


def live(n: int, level: str = "default") -> list[Sequence]:
    return [seq(f"l{i}", level, arrived_at=100.0 + i) for i in range(n)]


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.job_id for s in seqs]


def test_as_many_batch_jobs_go_as_live_jobs_wait_newest_started_first() -> None:
    held = [*batch(8), *live(3, "default:high")]
    assert ids(choose_victims(held, max_batch=8)) == ["b7", "b6", "b5"]


def test_no_batch_job_goes_while_every_job_has_a_slot() -> None:
    assert choose_victims([*batch(5), *live(3)], max_batch=8) == []
    assert choose_victims(batch(12), max_batch=8) == []  # batch jobs alone: nobody waits for them


def test_more_live_jobs_than_slots_take_every_batch_job_and_no_live_one() -> None:
    held = [*batch(4), *live(10, "default:low")]
    assert sorted(ids(choose_victims(held, max_batch=8))) == ["b0", "b1", "b2", "b3"]


def test_a_named_tenants_batch_jobs_are_batch_jobs_and_its_live_jobs_live() -> None:
    held = [*batch(2, tenant="acme"), *live(7, "default:normal:acme")]
    assert ids(choose_victims(held, max_batch=8)) == ["b1acme"]


def test_the_loop_hands_back_the_victims_once_and_only_when_on() -> None:
    held = [*batch(4), *live(2)]
    handed: list[list[str]] = []

    def preemption(enabled: bool) -> Preemption:
        return Preemption(enabled, max_batch=4, held=lambda: held, num_held=lambda: len(held),
                          hand_back=lambda seqs: handed.append(ids(seqs)))

    off = preemption(False)
    assert off.turn() == 0 and off.free_for_live() == 0 and handed == []
    on = preemption(True)
    assert on.free_for_live() == 4  # the live levels' credits count these slots as free
    assert on.turn() == 2 and handed == [["b3", "b2"]] and on.preempted == 2
