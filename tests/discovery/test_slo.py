"""SLO targets: durations, validation that names the field, the JSON stored in etcd."""

import re

import pytest

from pdserve.discovery.slo import SLOTargets
from pdserve.types.duration import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("0.5s", 0.5), ("2s", 2.0), ("1.5", 1.5), (" 250us ", 250e-6), ("1m", 60.0), ("1e-3s", 1e-3)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "ms", "fast", "-1s", "5 hours", "1.2.3s"])
def test_parse_duration_names_the_bad_value(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_duration(text)


def test_round_trip_json():
    slo = SLOTargets(model="org/llama", ttft_p90_s=0.5, itl_p90_s=0.05, e2e_p90_s=10.0, max_decode_replicas=12)
    assert SLOTargets.decode(slo.encode()) == slo
    assert b'"ttft_p90_s":0.5' in slo.encode()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"ttft_p90_s": 0.0}, "ttft_p90_s"),
        ({"itl_p90_s": -1.0}, "itl_p90_s"),
        ({"e2e_p90_s": float("inf")}, "e2e_p90_s"),
        ({"min_prefill_replicas": 0}, "min_prefill_replicas"),
        ({"min_decode_replicas": 3, "max_decode_replicas": 2}, "max_decode_replicas"),
        ({"model": ""}, "model"),
    ],
)
def test_validation_names_the_field(fields, named):
    values = {"model": "m", "ttft_p90_s": 0.5, "itl_p90_s": 0.05} | fields
    with pytest.raises(ValueError, match=named):
        SLOTargets(**values)


def test_decode_rejects_invalid_stored_values():
    with pytest.raises(ValueError, match="min_prefill_replicas"):
        SLOTargets.decode(b'{"model": "m", "ttft_p90_s": 0.5, "itl_p90_s": 0.05, "min_prefill_replicas": 0}')
    with pytest.raises(ValueError, match="do not decode"):
        SLOTargets.decode(b'{"model": "m"}')
