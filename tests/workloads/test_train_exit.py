"""How a rank leaves: `workloads.train.main` ignores SIGTERM once it has left the training loop,
so a second preemption notice cannot kill a rank while it saves or leaves, but only when the run
succeeded. A failed rank (a peer lost, an error) has nothing left to save, and its teardown can
take seconds with a peer gone: a stop's SIGTERM must end it at once, not after the stop's grace
(issue 42: the time to train again after a node is lost). In process, with the process group and
the trainer replaced: what is asserted is the SIGTERM disposition while the group is torn down."""

from __future__ import annotations

import signal

import pytest

import workloads.train as train

ARGS = ["--model", "tiny", "--steps", "1"]


def _teardown_disposition(monkeypatch, fit) -> tuple[object, object]:
    """main() with `fit` as the trainer's: SIGTERM's disposition when the group is torn down, and
    what main returned or raised."""
    seen: dict[str, object] = {}

    class Trainer:
        def __init__(self, cfg):
            pass

        def fit(self):
            fit()

    monkeypatch.setattr(train, "_init_distributed", lambda: None)
    monkeypatch.setattr(train, "Trainer", Trainer)
    monkeypatch.setattr(train.dist, "barrier", lambda: None)
    monkeypatch.setattr(
        train.dist, "destroy_process_group", lambda: seen.setdefault("teardown", signal.getsignal(signal.SIGTERM))
    )
    before = signal.getsignal(signal.SIGTERM)
    try:
        outcome: object = train.main(ARGS)
    except RuntimeError as e:
        outcome = e
    finally:
        signal.signal(signal.SIGTERM, before)
    return seen["teardown"], outcome


def test_a_finished_rank_still_ignores_sigterm_while_it_leaves(monkeypatch):
    disposition, outcome = _teardown_disposition(monkeypatch, lambda: None)
    assert outcome == 0
    assert disposition is signal.SIG_IGN


def test_a_failed_rank_is_ended_by_a_stops_sigterm_at_once(monkeypatch):
    def peer_gone():
        raise RuntimeError("Connection closed by peer [10.0.0.3]:31877")

    disposition, outcome = _teardown_disposition(monkeypatch, peer_gone)
    assert isinstance(outcome, RuntimeError)
    assert disposition is signal.SIG_DFL


@pytest.mark.parametrize("error", ["config", "checkpoint"])
def test_a_rank_that_fails_with_one_line_is_ended_by_sigterm_too(monkeypatch, error):
    def fails():
        raise train.ConfigError("bad") if error == "config" else train.CheckpointError("corrupt")

    disposition, outcome = _teardown_disposition(monkeypatch, fails)
    assert outcome in (train.EXIT_BAD_ARGS, 1)
    assert disposition is signal.SIG_DFL
