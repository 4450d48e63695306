import math

import pytest

from apr.config.schema import AlertConfig
from apr.errors import AprError
from apr.track.alerts import AlertEvaluator, alert_findings


def _ev(*alerts):
    return AlertEvaluator([AlertConfig(**a) for a in alerts])


def test_warn_fires_once_per_episode_and_stop_every_time():
    ev = _ev({"condition": "loss > 10", "action": "warn", "message": "high"},
             {"condition": "grad_norm > 100", "action": "stop"})
    fired = [[(a.condition, a.action) for a in ev.check({"loss": v, "grad_norm": 1.0})] for v in (11, 12, 5, 13)]
    assert fired == [[("loss > 10", "warn")], [], [], [("loss > 10", "warn")]]
    for _ in range(2):
        (a,) = ev.check({"loss": 1.0, "grad_norm": 150.0}, step=7)
        assert (a.action, a.step) == ("stop", 7)
        assert a.message == "alert: grad_norm > 100 (grad_norm=150)"


def test_message_carries_the_values_that_fired():
    (a,) = _ev({"condition": "loss > 10 && step > 5", "action": "stop", "message": "Loss exploded"}).check(
        {"loss": 23.5, "step": 9}, step=9
    )
    assert a.message.startswith("Loss exploded (")
    assert "loss=23.5" in a.message and "step=9" in a.message
    assert a.to_dict()["condition"] == "loss > 10 && step > 5"


def test_aliases_and_missing_metrics():
    ev = _ev({"condition": "learning_rate > 0.01"}, {"condition": "gradient_norm > 5"},
             {"condition": "val_loss > 3"})
    fired = ev.check({"lr": 0.1, "grad_norm": 6.0})  # no val_loss yet: that one is skipped
    assert sorted(a.condition for a in fired) == ["gradient_norm > 5", "learning_rate > 0.01"]
    assert [a.condition for a in ev.check({"val_loss": 4.0})] == ["val_loss > 3"]
    assert ev.errors == []


def test_nan_is_not_an_alert_but_infinity_compares():
    ev = _ev({"condition": "loss > 10", "action": "stop"})
    assert ev.check({"loss": math.nan}) == []
    assert [a.action for a in ev.check({"loss": math.inf})] == ["stop"]
    assert ev.check({"loss": "not a number"}) == []


@pytest.mark.parametrize(
    "condition, code",
    [
        ("loss >", "alert.invalid_condition"),
        ("perplexity > 3", "alert.unknown_metric"),
        ("loss + 1.0", "alert.not_boolean"),
        ("loss + 1 > 2.0", "alert.invalid_condition"),  # CEL does not mix int and double in arithmetic
        ("loss > 'x'", "alert.invalid_condition"),
    ],
)
def test_bad_conditions_are_findings_with_the_key_path(condition, code):
    alerts = [AlertConfig(condition="loss > 1"), AlertConfig(condition=condition)]
    (f,) = alert_findings(alerts, file="cfg.yaml")
    assert f.code == code
    assert f.path == "monitoring.alerts[1].condition"
    assert f.file == "cfg.yaml"
    with pytest.raises(AprError):
        AlertEvaluator(alerts)


def test_cel_macros_are_accepted_and_fire():
    from apr.track.alerts import AlertEvaluator, alert_findings

    class A:
        def __init__(self, condition, action="stop", message=None):
            self.condition, self.action, self.message = condition, action, message

    alerts = [A("[loss, grad_norm].exists(x, x > 10)"), A("[loss].all(v, v < 0)")]
    assert alert_findings(alerts) == []
    fired = AlertEvaluator(alerts).check({"loss": 11.0, "grad_norm": 1.0}, step=3)
    assert [a.condition for a in fired] == ["[loss, grad_norm].exists(x, x > 10)"]
    bad = alert_findings([A("[loss].exists(x, x > nonsense)")])
    assert [f.code for f in bad] == ["alert.unknown_metric"] and bad[0].got == "nonsense"


def test_hostile_conditions_are_findings_not_crashes():
    from apr.track.alerts import alert_findings

    class A:
        condition, action, message = "(" * 2_000 + "loss > 1" + ")" * 2_000, "stop", None

    findings = alert_findings([A()])
    assert [f.code for f in findings] == ["alert.invalid_condition"] and "levels deep" in findings[0].message


def test_alert_conditions_on_in_training_task_scores():
    from apr.config.schema import AlertConfig
    from apr.track.alerts import AlertEvaluator, alert_findings

    ok = [AlertConfig(condition="eval.stdlib_nextline.acc < 0.3 || eval.mine.acc_norm < 0.2", action="stop")]
    assert alert_findings(ok) == []
    (bad,) = alert_findings([AlertConfig(condition="eval.stdlib_nextline.loss < 0.3")])
    assert bad.code == "alert.invalid_condition"
    ev = AlertEvaluator([AlertConfig(condition="eval.t.acc < 0.3", action="stop")])
    assert ev.check({"loss": 1.0}, step=1) == []  # no task evaluation yet: skipped
    (fired,) = ev.check({"eval": {"t": {"acc": 0.25, "acc_norm": 0.5}}}, step=2)
    assert fired.values == {"eval.t.acc": 0.25} and "eval.t.acc=0.25" in fired.message
    assert ev.check({"eval": {"t": {"acc": 0.5, "acc_norm": 0.5}}}, step=3) == []


def test_per_block_norms_in_conditions():
    ev = _ev({"condition": "block_grad_norm.exists(x, x > 5.0)", "action": "stop"},
             {"condition": "max_block_update_norm > 0.5"},
             {"condition": "block_update_norm[0] > 2.0 * head_update_norm"})
    calm = {"block_grad_norm": [1.0, 2.0, 3.0], "block_update_norm": [0.1, 0.2, 0.1], "max_block_update_norm": 0.2,
            "head_update_norm": 0.1}
    assert ev.check(calm) == []
    spike = {"block_grad_norm": [9.5, 2.0, 3.0], "block_update_norm": [0.9, 0.2, 0.1], "max_block_update_norm": 0.9,
             "head_update_norm": 0.1}
    fired = ev.check(spike, step=30)
    assert sorted(a.condition for a in fired) == sorted(
        ["block_grad_norm.exists(x, x > 5.0)", "max_block_update_norm > 0.5",
         "block_update_norm[0] > 2.0 * head_update_norm"])
    stop = next(a for a in fired if a.action == "stop")
    assert stop.message == "alert: block_grad_norm.exists(x, x > 5.0) (max(block_grad_norm)=9.5)"
    # a non-finite block (None in the state) leaves the condition to the non-finite check
    assert ev.check({**calm, "block_grad_norm": [None, 1.0, 1.0]}) == []
    assert ev.errors == []


def test_per_block_names_validate_and_need_block_norms_on():
    alerts = [AlertConfig(condition="block_grad_norm.exists(x, x > 5.0)"),
              AlertConfig(condition="max_block_grad_norm > 5.0")]
    assert alert_findings(alerts) == []
    found = alert_findings(alerts, file="run.yaml", block_norms=False)
    assert [f.code for f in found] == ["alert.block_norms_off"] * 2
    assert found[0].path == "monitoring.alerts[0].condition" and "block_grad_norm" in found[0].message
    assert found[1].got == "monitoring.block_norms: false"


def test_data_drift_conditions_that_could_never_be_checked_are_refused():
    alerts = [AlertConfig(condition="data_drift_psi > 0.25"), AlertConfig(condition="loss > 9.0")]
    assert alert_findings(alerts) == []
    found = alert_findings(alerts, file="run.yaml", data_drift_off="monitoring.data_drift.interval is 0")
    assert [(f.code, f.path) for f in found] == [("alert.data_drift_off", "monitoring.alerts[0].condition")]
    assert "data_drift_psi" in found[0].message and found[0].got == "monitoring.data_drift.interval is 0"


def test_severities_fire_like_their_action_and_are_carried():
    ev = _ev({"condition": "loss > 5", "severity": "critical"}, {"condition": "loss > 4", "severity": "info"},
             {"condition": "loss > 3", "action": "stop"}, {"condition": "loss > 2"})
    first = ev.check({"loss": 6.0}, step=1)
    assert [(a.severity, a.action) for a in first] == [
        ("critical", "stop"), ("info", "warn"), ("error", "stop"), ("warning", "warn")]
    again = ev.check({"loss": 6.0}, step=2)  # info and warning fire once per episode, the others each time
    assert [a.severity for a in again] == ["critical", "error"]
    assert first[0].to_dict()["severity"] == "critical" and first[0].to_dict()["action"] == "stop"


@pytest.mark.parametrize("fields, ok", [
    ({"severity": "critical", "action": "stop"}, True), ({"severity": "info", "action": "warn"}, True),
    ({"severity": "critical", "action": "warn"}, False), ({"severity": "warning", "action": "stop"}, False)])
def test_severity_and_the_older_action_must_agree(fields, ok):
    from pydantic import ValidationError

    if ok:
        assert AlertConfig(condition="loss > 1", **fields).effective_severity == fields["severity"]
    else:
        with pytest.raises(ValidationError, match="expected severity and action to agree"):
            AlertConfig(condition="loss > 1", **fields)
