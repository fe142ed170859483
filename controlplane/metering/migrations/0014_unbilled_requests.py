# The rollups count apart every request not billed (refused or failed before an engine worked
# on it), not only failed ones, and sum only billed usage: statements, the monthly summary and
# the per-image report then count the same requests and images. Every period is rolled up again.

from django.db import migrations


def _roll_up_again(apps, schema_editor):
    apps.get_model("metering", "RollupState").objects.all().delete()


class Migration(migrations.Migration):

    dependencies = [
        ('metering', '0013_usage_event_rate'),
    ]

    operations = [
        migrations.RenameField(model_name='dailyusage', old_name='failed_requests', new_name='unbilled_requests'),
        migrations.RenameField(model_name='hourlyusage', old_name='failed_requests', new_name='unbilled_requests'),
        migrations.RunPython(_roll_up_again, migrations.RunPython.noop),
    ]
