"""A `Ride` (tiers/burst.py): what the owner of a burst waits on, and what ends it."""

from tierflow.tiers.burst import Ride


def test_a_ride_with_nothing_to_stage_is_covered_at_once():
    assert Ride(5.0, 0.0).wait(timeout=0)
    alone = Ride(5.0, 1e6)
    assert alone.wait(timeout=0)  # no stager behind it (no on_end): nothing will stage for it
    alone.end()  # and its end tells no one
    assert alone.wait(timeout=0)


def test_a_ride_waits_for_its_stager_and_ends_once():
    ended: list[Ride] = []
    ride = Ride(5.0, 1e6, ended.append)
    assert not ride.wait(timeout=0)
    ride.staged()
    assert ride.wait(timeout=0)
    ride.end()
    ride.end()
    assert ended == [ride]


def test_ending_a_ride_releases_its_waiter_even_when_nothing_was_staged():
    ride = Ride(5.0, 1e6, lambda r: None)
    ride.end()
    assert ride.wait(timeout=0)
