"""benchmarks/sim_timeline.py's reading of a wave boundary (B3's turnaround), on a made-up timeline:
each mark is the time of its first or last event after the wave's finished outputs were delivered,
events outside the boundary (before the delivery, after the next launch) are left out, a launch of
one row is not the next wave's, and a timeline without the client's side still reads."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from sim_timeline import wave_turnarounds  # noqa: E402

WAVE = 4


def timeline(with_client: bool = True) -> dict:
    t = 10.0   # the wave's outputs delivered; everything below in seconds after it
    tl = {"launches": [[t - 0.5, WAVE, 16], [t + 0.004, 1, 1], [t + 0.030, WAVE, 1], [t + 0.040, WAVE, 16]],
          "finishes": [[t - 0.001, WAVE]], "delivers": [[t, WAVE]],
          "stream_ends": [t + 0.001, t + 0.002], "receives": [t + 0.005, t + 0.015],
          "submits": [t - 0.2, t + 0.008, t + 0.025, t + 0.035], "arrivals": [t + 0.009, t + 0.027],
          "idle": []}
    if with_client:
        tl |= {"client_sends": [t + 0.0015, t + 0.003], "client_ends": [t + 0.0012, t + 0.0025]}
    return tl


def test_wave_marks_in_ms_from_the_delivery():
    [wave] = wave_turnarounds(timeline(), WAVE)
    assert wave == {"streams ended": 2.0, "client read last end": 2.5, "client first send": 1.5,
                    "client last send": 3.0, "first received": 5.0, "last received": 15.0,
                    "first submit": 8.0, "last submit": 25.0, "first add": 9.0, "last add": 27.0,
                    "next launch": 30.0}


def test_without_the_client_side():
    [wave] = wave_turnarounds(timeline(with_client=False), WAVE)
    assert "client last send" not in wave and wave["next launch"] == pytest.approx(30.0)


def test_smaller_finishes_are_no_wave():
    assert wave_turnarounds(timeline(), WAVE + 1) == []
