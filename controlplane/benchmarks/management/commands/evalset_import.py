"""Import an evaluation set from a file too big to upload: JSONL, VLMEvalKit's TSV, or a zip."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from controlplane.benchmarks import evalsets
from controlplane.benchmarks.models import EvalItem


class Command(BaseCommand):
    help = ("Import an evaluation set: every row is checked first, and the set is saved only if none "
            "is refused (the refused rows are listed with their numbers).")

    def add_arguments(self, parser):
        parser.add_argument("path", help=".jsonl, .tsv, or a .zip holding one of them with its images")
        parser.add_argument("--name", required=True, help="the set's name")
        parser.add_argument("--description", default="")
        parser.add_argument("--task-type", default=EvalItem.TaskType.REASONING, choices=EvalItem.TaskType.values,
                            help="for rows that name no task_type")

    def handle(self, *args, path, name, description, task_type, **options):
        source = Path(path)
        if not source.is_file():
            raise CommandError(f"{path}: no such file")

        def progress(read, total, errors, error_count):
            done = int(40 * read / total) if total else 40
            self.stderr.write(f"\r[{'#' * done}{'.' * (40 - done)}] {read}/{total} rows, {error_count} refused",
                              ending="")

        try:
            eval_set, errors, error_count = evalsets.evalset_import_read(
                name=name, description=description, file_name=source.name, data=source.read_bytes(),
                task_type=task_type, on_progress=progress)
        except evalsets.EvalSetError as exc:
            raise CommandError(str(exc)) from None
        finally:
            self.stderr.write("")
        if eval_set is None:
            for row, reason in errors:
                self.stderr.write(f"row {row}: {reason}")
            if error_count > len(errors):
                self.stderr.write(f"... and {error_count - len(errors)} more")
            raise CommandError(f"{error_count} rows refused; nothing was imported")
        self.stdout.write(f"imported {eval_set.items.count()} items as set {eval_set.name!r} (id {eval_set.pk})")
