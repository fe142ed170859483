from django.db import models


class InFlightRequest(models.Model):
    """A request a gateway is forwarding, journaled until its usage is recorded (embedded mode;
    with Redis the journal is a pair of hashes). What a dead gateway leaves here is recorded
    as interrupted by the ingest task."""

    request_id = models.CharField(max_length=64, unique=True)
    record = models.JSONField()
    instance_id = models.IntegerField(null=True, blank=True)
    produced = models.PositiveIntegerField(default=0)
    beat_at = models.DateTimeField(db_index=True)
    # The reaper's first look: the beat it found stale, and when. It reaps on a second look,
    # two heartbeats later, only if the beat is still that one.
    suspected_beat = models.DateTimeField(null=True, blank=True)
    suspected_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return self.request_id
