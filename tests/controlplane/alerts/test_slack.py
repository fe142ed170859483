"""The message posted for an alert (pure: no Django)."""

import datetime as dt

from controlplane.alerts.slack import alert_message, escape

FIRED_AT = dt.datetime(2026, 5, 4, 12, 0, tzinfo=dt.UTC)


def test_it_says_what_fired_in_text_every_slack_style_receiver_shows():
    body = alert_message(event="fired", rule="Quota 80 % used", subject="tenant:acme",
                         message="tenant acme has used 85 % of its image tokens", fired_at=FIRED_AT)
    assert body["text"] == (":rotating_light: *FIRING* Quota 80 % used · tenant:acme: "
                            "tenant acme has used 85 % of its image tokens")
    assert body["blocks"][1]["elements"][0]["text"] == "fired 2026-05-04 12:00:00 UTC"


def test_it_says_how_long_a_resolved_alert_lasted():
    body = alert_message(event="resolved", rule="r", subject="instance:3", message="…", fired_at=FIRED_AT,
                         resolved_at=FIRED_AT + dt.timedelta(hours=2, minutes=5), resolution="cleared: running")
    assert body["text"] == ":white_check_mark: *RESOLVED* r · instance:3: cleared: running"
    assert body["blocks"][1]["elements"][0]["text"].endswith("after 2 h 5 min")


def test_names_cannot_become_links_or_mentions():
    assert escape("<!channel> & <https://evil|click>") == "&lt;!channel&gt; &amp; &lt;https://evil|click&gt;"
    body = alert_message(event="fired", rule="<!here>", subject="tier:x", message="a < b", fired_at=FIRED_AT)
    assert "<" not in body["text"]
