"""Measure what large-image isolation and text priority do for text latency (isolation.py)."""

import logging

from django.core.management.base import BaseCommand

from controlplane.benchmarks.isolation import run_experiment, table


class Command(BaseCommand):
    help = ("Benchmark text-only, mixed and isolated traffic through the gateway against simulated "
            "engines, and print the text latency table.")

    def add_arguments(self, parser):
        parser.add_argument("--text-rate", type=float, default=4.0, help="text requests per second")
        parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per benchmark")
        parser.add_argument("--seed", type=int, default=1)

    def handle(self, *args, text_rate, duration, seed, **options):
        # One line per request from the HTTP client would bury the table.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        rows = run_experiment(text_rate=text_rate, duration_s=duration, seed=seed,
                              out=lambda line: self.stdout.write(line))
        self.stdout.write(table(rows))
