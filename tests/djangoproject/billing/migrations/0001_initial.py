from django.db import migrations, models

from celery_lockguard import fence_table_sql


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Invoice",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("amount_cents", models.IntegerField(default=0)),
                ("paid", models.BooleanField(default=False)),
                ("charges", models.IntegerField(default=0)),
                ("reminders", models.IntegerField(default=0)),
                ("fence", models.BigIntegerField(null=True)),
            ],
        ),
        # The table advance_fence checks, created by a migration like any other table of the project.
        migrations.RunSQL(fence_table_sql(), reverse_sql="DROP TABLE lockguard_fences"),
    ]
