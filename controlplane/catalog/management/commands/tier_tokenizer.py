"""Give a tier its model's tokenizer and chat template, from a directory holding the model's
tokenizer.json and tokenizer_config.json (or chat_template.jinja), so the gateway counts its
prompts exactly. Node agents do this themselves for models they have on disk."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from controlplane.catalog.models import ModelTier
from controlplane.catalog.tokenizers import TokenizerFilesError, tier_tokenizer_store


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument("--tier", required=True)
        parser.add_argument("directory", type=Path)

    def handle(self, *args, tier, directory, **options):
        found = ModelTier.objects.filter(name=tier).first()
        if found is None:
            raise CommandError(f"no tier named {tier!r}")
        try:
            stored = tier_tokenizer_store(tier=found, directory=directory, source=f"uploaded from {directory}")
        except TokenizerFilesError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{found.name}: tokenizer {stored.digest[:12]} stored")
