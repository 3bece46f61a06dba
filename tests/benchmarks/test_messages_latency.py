"""``benchmarks/speed/messages_latency.py`` on the tiny model, briefly: both APIs timed, every
recording exact, the ratio line printed."""

import re

import messages_latency


def test_both_apis_are_timed_and_every_recording_is_exact(capsys):
    assert messages_latency.main(["--rounds", "1", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    firsts = dict(re.findall(r"^  (.+?)\s+first text (\S+) s", out, re.M))
    assert set(firsts) == {"chat completions", "messages", "chat, plain http",
                           "messages, plain http"}, out
    assert all(float(v) > 0 for v in firsts.values())
    assert "recorded ids equal the sampled ones: 8/8 replies" in out  # warm-ups included
    assert re.search(r"^ratio: messages / chat first-token seconds = \d+\.\d\d$", out, re.M)
