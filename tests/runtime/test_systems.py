"""The system specs the control loop reads, and how the leader combines hosts' signals."""

import pytest

from tidejax.config import RunConfig
from tidejax.runtime.controller import NO_ARRIVALS_S, batch_shares, combine_rollout_digests
from tidejax.sched.systems import SYSTEMS


def test_each_system_is_what_its_name_says():
    assert SYSTEMS["sync"].phased and SYSTEMS["sync"].staleness_bound(2) == 0
    assert [name for name, s in SYSTEMS.items() if s.elastic] == ["tide"]
    assert [name for name, s in SYSTEMS.items() if s.pins_kv] == ["tide"]
    assert SYSTEMS["stream"].trainer_mode == "alternating"
    assert SYSTEMS["async"].staleness_bound(2) == 2
    assert SYSTEMS["tide"].trainer_mode is None  # RA2P's plan chooses


def test_config_refuses_an_unknown_system_naming_the_field():
    with pytest.raises(ValueError, match="RunConfig.system"):
        RunConfig(system="areal")


def test_one_host_digest_is_the_plan_input_unchanged():
    digest = {"ready_tokens": 700, "ready_groups": 3, "tprm_s": 0.3, "hol_s": 1.5,
              "dropped_groups": 1, "idle_frac": 0.25}
    assert combine_rollout_digests([digest]) == digest


def test_two_hosts_digests_combine_as_one_rollout():
    a = {"ready_tokens": 700, "ready_groups": 3, "tprm_s": 2.0, "hol_s": 1.5,
         "dropped_groups": 1, "idle_frac": 0.2}
    b = {"ready_tokens": 300, "ready_groups": 1, "tprm_s": 2.0, "hol_s": 4.0,
         "dropped_groups": 0, "idle_frac": 0.6}
    combined = combine_rollout_digests([a, b])
    # A micro-batch every 2 s on each host: one every second between them.
    assert combined["tprm_s"] == pytest.approx(1.0)
    assert combined == {"ready_tokens": 1000, "ready_groups": 4, "tprm_s": combined["tprm_s"],
                        "hol_s": 4.0, "dropped_groups": 1,
                        "idle_frac": pytest.approx(0.4)}


def test_a_host_with_no_arrivals_adds_no_rate():
    none_arrived = {"ready_tokens": 0, "ready_groups": 0, "tprm_s": NO_ARRIVALS_S, "hol_s": 0.0,
                    "dropped_groups": 0, "idle_frac": 1.0}
    busy = dict(none_arrived, tprm_s=0.5, idle_frac=0.0)
    assert combine_rollout_digests([none_arrived, busy])["tprm_s"] == pytest.approx(0.5)
    assert combine_rollout_digests([none_arrived, none_arrived])["tprm_s"] == NO_ARRIVALS_S


def _digest(ready: int, stop=None, phase_over: bool = True, due_ready: int = 0,
            due_in_flight: int = 0) -> dict:
    return {"ready": ready, "due_ready": due_ready, "due_in_flight": due_in_flight,
            "stop": stop, "phase_over": phase_over}


def test_the_batch_is_shared_in_turn_once_enough_is_ready_between_the_hosts():
    assert batch_shares([_digest(3), _digest(1)], 6, take_all=False) == {"wait": True}
    assert batch_shares([_digest(5), _digest(1)], 6, take_all=False) == {"take": [5, 1]}
    assert batch_shares([_digest(5), _digest(5)], 6, take_all=False) == {"take": [3, 3]}


def test_deadline_shares_wait_for_due_groups_on_any_host_and_take_each_hosts_due_first():
    # Host 1 still runs a due group: host 0's 6 fast groups cannot fill the batch of 6.
    assert batch_shares([_digest(6), _digest(0, due_in_flight=1)], 6,
                        take_all=False) == {"wait": True}
    # It finished: host 1 gives it (its one due group) even though host 0 alone has 6.
    assert batch_shares([_digest(6), _digest(1, due_ready=1)], 6,
                        take_all=False) == {"take": [5, 1]}
    # Every host's due ready groups come first, the rest dealt in turn.
    assert batch_shares([_digest(6, due_ready=3), _digest(6, due_ready=1)], 6,
                        take_all=False) == {"take": [4, 2]}


def test_a_phased_batch_waits_for_every_hosts_phase_then_takes_all_it_has():
    assert batch_shares([_digest(4), _digest(2, phase_over=False)], 8,
                        take_all=True) == {"wait": True}
    assert batch_shares([_digest(4), _digest(3)], 8, take_all=True) == {"take": [4, 3]}


def test_a_stop_on_any_host_stops_every_host():
    assert batch_shares([_digest(0, phase_over=False), _digest(9, stop=15)], 8,
                        take_all=True) == {"stop": 15}
