"""A worker rank's place in a group across hosts: from --leader-address/--group-size/--group-index,
or from a LeaderWorkerSet's variables; every bad setting named before anything starts."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, main
from pdserve.cli.serve import worker_config
from pdserve.distributed.placement import RENDEZVOUS_PORT, GroupPlacement, parse_leader_address

MODEL = ["--model", "/models/m", "--etcd", "http://127.0.0.1:2379"]
LWS = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


@pytest.fixture(autouse=True)
def _no_lws(monkeypatch):
    for name in LWS:
        monkeypatch.delenv(name, raising=False)


def config(*options: str):
    return worker_config(build_parser().parse_args(["decode", *MODEL, *options]))


def test_without_settings_the_group_is_local():
    assert config("--tensor-parallel-size", "2").placement is None


def test_the_flags_place_the_rank():
    placed = config(
        "--tensor-parallel-size", "2", "--leader-address", "10.0.0.5", "--group-size", "2", "--group-index", "1"
    )
    assert placed.placement == GroupPlacement(
        leader_host="10.0.0.5", leader_port=RENDEZVOUS_PORT, group_size=2, group_index=1
    )
    assert not placed.placement.is_leader


def test_a_leader_worker_sets_variables_place_the_rank_and_flags_win(monkeypatch):
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "group-0.group.ns")
    monkeypatch.setenv("LWS_GROUP_SIZE", "4")
    monkeypatch.setenv("LWS_WORKER_INDEX", "3")
    both = config("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel")
    assert (both.placement.group_size, both.placement.group_index) == (4, 3)  # DP rank 1's TP rank 1
    placed = config("--tensor-parallel-size", "4")
    assert (placed.placement.leader_host, placed.placement.group_index) == ("group-0.group.ns", 3)
    flags = config(
        "--tensor-parallel-size", "2", "--leader-address", "h:7000", "--group-size", "2", "--group-index", "0"
    )
    assert (flags.placement.leader_port, flags.placement.group_index) == (7000, 0)
    monkeypatch.setenv("LWS_WORKER_INDEX", "three")
    with pytest.raises(ValueError, match=r"\$LWS_WORKER_INDEX must be a whole number, got 'three'"):
        config("--tensor-parallel-size", "4")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--group-index", "2", "--group-size", "2"), "group index 2 is out of range for a group of 2 ranks"),
        (("--group-index", "-1", "--group-size", "2"), "group index -1 is out of range"),
        (
            ("--group-size", "3", "--group-index", "1"),
            "group size 3 does not match the group's ranks: tensor_parallel_size 2",
        ),
        (
            (
                "--group-index",
                "1",
            ),
            "missing leader address, group size",
        ),
        (("--leader-address", "h:port", "--group-size", "2", "--group-index", "1"), "port 'port' is not a number"),
        (("--leader-address", "h:0", "--group-size", "2", "--group-index", "1"), "leader port must be in"),
    ],
)
def test_bad_group_settings_are_named(options, message):
    leader = () if "--leader-address" in options or options == ("--group-index", "1") else ("--leader-address", "h")
    with pytest.raises(ValueError, match=message):
        config("--tensor-parallel-size", "2", *leader, *options)


def test_the_command_refuses_bad_settings_before_it_loads_anything(capsys):
    status = main(
        [
            "decode",
            *MODEL,
            "--tensor-parallel-size",
            "2",
            "--leader-address",
            "h",
            "--group-size",
            "2",
            "--group-index",
            "5",
        ]
    )
    assert status == 2
    assert "group index 5 is out of range for a group of 2 ranks (0..1)" in capsys.readouterr().err


def test_leader_addresses_parse():
    assert parse_leader_address("node-0.svc") == ("node-0.svc", RENDEZVOUS_PORT)
    assert parse_leader_address("10.1.2.3:1234") == ("10.1.2.3", 1234)
    assert parse_leader_address("[fd00::1]:99") == ("fd00::1", 99)
    assert parse_leader_address("fd00::1") == ("fd00::1", RENDEZVOUS_PORT)
    with pytest.raises(ValueError, match="names no host"):
        parse_leader_address(":80")
