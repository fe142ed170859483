from django.db import migrations

# Task types as they were, and as they are.
TASK_TYPES = {"ocr": "read", "chart": "chart", "description": "description", "reasoning": "reasoning",
              "hallucination": "presence"}


def profile_items_to_sets(apps, schema_editor):
    """Each profile's items become a set of their own, which the profile then uses. A
    hallucination probe (right when the answer is a negative) is a presence question whose
    answer is "no"."""
    EvalSet = apps.get_model("benchmarks", "EvalSet")
    EvalItem = apps.get_model("benchmarks", "EvalItem")
    BenchmarkProfile = apps.get_model("benchmarks", "BenchmarkProfile")
    taken = set(EvalSet.objects.values_list("name", flat=True))
    for profile in BenchmarkProfile.objects.filter(eval_items__isnull=False).distinct().order_by("pk"):
        name, n = f"{profile.name} items", 1
        while name in taken:
            n += 1
            name = f"{profile.name} items {n}"
        taken.add(name)
        eval_set = EvalSet.objects.create(name=name, source="profile",
                                          description=f"The evaluation items of profile {profile.name}")
        for row, item in enumerate(EvalItem.objects.filter(profile=profile).order_by("task_type", "pk"), 1):
            item.eval_set = eval_set
            item.row = row
            item.task_type = TASK_TYPES.get(item.task_type, item.task_type)
            lines = [line.strip() for line in item.expected.splitlines() if line.strip()]
            item.answers = ["no"] if item.task_type == "presence" else lines
            item.meta = {"name": item.name} if item.name else {}
            item.save(update_fields=["eval_set", "row", "task_type", "answers", "meta"])
        profile.eval_set = eval_set
        profile.save(update_fields=["eval_set"])


def sets_to_profile_items(apps, schema_editor):
    """Back: the items of a set a profile uses become that profile's (the first profile's)."""
    EvalItem = apps.get_model("benchmarks", "EvalItem")
    back = {new: old for old, new in TASK_TYPES.items()}
    for item in EvalItem.objects.select_related("eval_set"):
        profile = item.eval_set.profiles.order_by("pk").first() if item.eval_set_id else None
        if profile is None:
            item.delete()
            continue
        item.profile = profile
        item.task_type = back.get(item.task_type, "reasoning")
        item.expected = "\n".join(item.answers)
        item.name = (item.meta or {}).get("name", f"row {item.row}")
        item.save(update_fields=["profile", "task_type", "expected", "name"])


class Migration(migrations.Migration):

    dependencies = [
        ("benchmarks", "0006_eval_sets"),
    ]

    operations = [
        migrations.RunPython(profile_items_to_sets, sets_to_profile_items),
    ]
