from django.db import models


class Invoice(models.Model):
    """What the tasks write: ``charges`` and ``reminders`` count runs, ``fence`` is the fence of the last write."""

    amount_cents = models.IntegerField(default=0)
    paid = models.BooleanField(default=False)
    charges = models.IntegerField(default=0)
    reminders = models.IntegerField(default=0)
    fence = models.BigIntegerField(null=True)
