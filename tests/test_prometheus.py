"""The Prometheus text format as the official parser (prometheus_client) reads it back."""

from prometheus_client.parser import text_string_to_metric_families

from turnrl.prometheus import exposition, metric_name


def test_exposition_escapes_labels_and_help_as_prometheus_reads_them():
    text = exposition([("x_total", "counter", 'a "help" \\ line',
                        [({"route": 'a"b\\c\nd'}, 3.0)]),
                       ("y", "gauge", "plain", [({}, 0.25)]),
                       ("z", "gauge", "odd", [({}, float("inf"))])])
    (x,), (y,), (z,) = (f.samples for f in text_string_to_metric_families(text))
    assert x.labels == {"route": 'a"b\\c\nd'} and x.value == 3.0
    assert y.value == 0.25 and z.value == float("inf")
    assert "# TYPE x_total counter" in text and text.endswith("\n")


def test_metric_names_keep_only_what_prometheus_allows():
    assert metric_name("reward/mean") == "turnrl_reward_mean"
    assert metric_name("eval/pass@4") == "turnrl_eval_pass_4"
    assert metric_name("time/step_s", "x_") == "x_time_step_s"
