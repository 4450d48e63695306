"""The ranks' agreement on a step's stop and signal (apr/train/stop.py ``agree``): one snapshot of
the signal per agreement, every rank's flags combined, and only host integers exchanged (the run
loop's two-rank behaviour is tested end to end in tests/distributed/test_data_parallel.py)."""

from __future__ import annotations

import signal

from apr.train.stop import Stop, agree


class Signals:
    def __init__(self, received=None):
        self.received = received


class OtherRank:
    """A stand-in for ``DataParallel`` whose other rank holds ``theirs``; records what was sent."""

    def __init__(self, theirs: list[int]):
        self.theirs, self.sent = theirs, []

    def any_host(self, flags):
        self.sent.append(list(flags))
        return [max(a, b) for a, b in zip(flags, self.theirs, strict=True)]


def test_one_process_reads_the_signal_once_and_keeps_its_own_stop():
    signals, stop = Signals(), Stop.alert("loss spike")
    assert agree(stop, signals, None) == (stop, None)
    signals.received = signal.SIGTERM
    assert agree(None, signals, None) == (None, signal.SIGTERM)


def test_a_signal_on_the_other_rank_is_agreed_and_recorded_here():
    signals, dp = Signals(), OtherRank([int(signal.SIGTERM), 0, 0])
    stop, sig = agree(None, signals, dp)
    assert stop is None and sig == signal.SIGTERM
    assert signals.received == signal.SIGTERM  # a second signal on this rank now exits at once
    assert all(type(v) is int for v in dp.sent[0])  # host integers: nothing read from a device


def test_a_stop_on_the_other_rank_stops_this_one_and_keeps_its_no_checkpoint_decision():
    stop, sig = agree(None, Signals(), OtherRank([0, 1, 1]))  # a critical alert there: no checkpoint
    assert sig is None and stop is not None and stop.status == "stopped" and not stop.checkpoint
    stop, _ = agree(None, Signals(), OtherRank([0, 1, 0]))
    assert stop.checkpoint and stop.exit_code == 1


def test_this_ranks_own_stop_and_signal_stand_and_are_sent():
    mine = Stop.critical("non-finite weights")
    dp = OtherRank([0, 0, 0])
    stop, sig = agree(mine, Signals(int(signal.SIGINT)), dp)
    assert stop is mine and sig == signal.SIGINT
    assert dp.sent == [[int(signal.SIGINT), 1, 1]]


def test_nothing_anywhere_is_no_stop():
    assert agree(None, Signals(), OtherRank([0, 0, 0])) == (None, None)
