# A plan bills in one of the currencies listed in catalog.models.CURRENCIES.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('catalog', '0007_routing_defaults'),
    ]

    operations = [
        migrations.AlterField(
            model_name='priceplan',
            name='currency',
            field=models.CharField(choices=[('USD', 'USD'), ('EUR', 'EUR'), ('GBP', 'GBP'), ('JPY', 'JPY'), ('CNY', 'CNY'), ('CHF', 'CHF'), ('CAD', 'CAD'), ('AUD', 'AUD'), ('INR', 'INR'), ('SGD', 'SGD'), ('KRW', 'KRW'), ('BRL', 'BRL'), ('SEK', 'SEK')], default='USD', max_length=3),
        ),
    ]
