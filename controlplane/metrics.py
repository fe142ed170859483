"""The control plane's own /metrics: the fleet as the database knows it, this gateway
process's request counters and today's metered image tokens. Scraped by Prometheus beside the
engines' own /metrics; it reads several apps, so it sits above them."""

from __future__ import annotations

import hmac
from collections import Counter

from django.conf import settings
from django.db.models import Sum
from django.http import HttpResponse
from django.utils import timezone

from controlplane.fleet.models import EngineInstance
from controlplane.gateway.apps import current_process
from controlplane.metering.models import DailyUsage
from controlplane.metering.records import ESCALATIONS


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _line(name: str, labels: dict, value) -> str:
    inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {float(value):g}"


def render() -> str:
    instances = list(EngineInstance.objects.select_related("tier").order_by("id"))
    out = ["# HELP vlmcp_engine_instances Engine instances by tier and state.",
           "# TYPE vlmcp_engine_instances gauge"]
    by_state = Counter((i.tier.name, i.actual_state) for i in instances)
    out += [_line("vlmcp_engine_instances", {"tier": tier, "state": state}, n) for (tier, state), n in by_state.items()]
    per_instance = {
        "vlmcp_engine_healthy": ("Whether the instance passed its last health check.", "healthy"),
        "vlmcp_engine_kv_cache_usage": ("KV cache in use, 0..1, from the engine's last scrape.", "kv_cache_usage"),
        "vlmcp_engine_requests_running": ("Requests running on the engine at its last scrape.", "num_running"),
        "vlmcp_engine_requests_waiting": ("Requests waiting on the engine at its last scrape.", "num_waiting"),
        "vlmcp_engine_restarts": ("Restarts since the instance was last healthy for 10 minutes.", "restart_count"),
    }
    for name, (help_text, attribute) in per_instance.items():
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        out += [_line(name, {"instance": i.pk, "tier": i.tier.name}, getattr(i, attribute)) for i in instances]
    requests, image_tokens, disagreements, pictures = current_process().counters.snapshot()
    out += ["# HELP vlmcp_gateway_requests_total Requests this gateway process answered.",
            "# TYPE vlmcp_gateway_requests_total counter"]
    out += [_line("vlmcp_gateway_requests_total", {"tier": t, "status": s}, n) for (t, s), n in sorted(requests.items())]
    out += ["# HELP vlmcp_gateway_image_tokens_total Image tokens this gateway process sent to engines.",
            "# TYPE vlmcp_gateway_image_tokens_total counter"]
    out += [_line("vlmcp_gateway_image_tokens_total", {"tier": t}, n) for t, n in sorted(image_tokens.items())]
    out += ["# HELP vlmcp_gateway_image_token_disagreements_total Answers whose engine counted other "
            "image tokens than the gateway.",
            "# TYPE vlmcp_gateway_image_token_disagreements_total counter"]
    out += [_line("vlmcp_gateway_image_token_disagreements_total", {"tier": t}, n)
            for t, n in sorted(disagreements.items())]
    out += ["# HELP vlmcp_gateway_images_total Pictures this gateway process prepared for engines: new, or "
            "again (sent before by the same tenant, under the same policy: what they became was kept).",
            "# TYPE vlmcp_gateway_images_total counter"]
    out += [_line("vlmcp_gateway_images_total", {"tier": t, "prepared": how}, n)
            for (t, how), n in sorted(pictures.items())]
    out += ["# HELP vlmcp_gateway_shared_pictures_total What the store of pictures the gateway replicas "
            "share did for this process: hit, miss, failed (unreachable or slow: the picture is prepared "
            "here), dropped (too many waiting to be written).",
            "# TYPE vlmcp_gateway_shared_pictures_total counter"]
    out += [_line("vlmcp_gateway_shared_pictures_total", {"outcome": outcome}, n)
            for outcome, n in sorted(current_process().counters.shared_snapshot().items())]
    out += ["# HELP vlmcp_gateway_cascades_total A routing rule's cascades this process ran, by how the first "
            f"answer went: kept, escalated (for {', '.join(ESCALATIONS)}), or not_escalated (the second attempt "
            "was not answered: the first answer was sent).",
            "# TYPE vlmcp_gateway_cascades_total counter"]
    out += [_line("vlmcp_gateway_cascades_total", {"rule": rule, "outcome": outcome}, n)
            for (rule, outcome), n in sorted(current_process().counters.cascade_snapshot().items())]
    out += ["# HELP vlmcp_gateway_auth_refusals_total Requests this gateway process refused at authentication, "
            "by why: missing (no key sent) and unknown (no key of ours), which no tenant's usage records; revoked, "
            "expired and tenant_inactive, which their tenant's request log shows.",
            "# TYPE vlmcp_gateway_auth_refusals_total counter"]
    out += [_line("vlmcp_gateway_auth_refusals_total", {"reason": reason}, n)
            for reason, n in sorted(current_process().counters.auth_refusal_snapshot().items())]
    out += ["# HELP vlmcp_usage_image_tokens_today Image tokens metered today (UTC), from the rollups.",
            "# TYPE vlmcp_usage_image_tokens_today gauge"]
    today = DailyUsage.objects.filter(day=timezone.now().date(), tier__isnull=False).values("tier__name").annotate(
        tokens=Sum("image_tokens")).order_by("tier__name")
    out += [_line("vlmcp_usage_image_tokens_today", {"tier": r["tier__name"]}, r["tokens"]) for r in today]
    return "\n".join(out) + "\n"


def metrics(request):
    token = settings.METRICS_TOKEN
    if token:
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent, f"Bearer {token}"):
            return HttpResponse("unauthorized\n", status=401, content_type="text/plain")
    elif not settings.DEBUG:
        # Tenants, tiers and volumes are the operator's business: no token, no metrics.
        return HttpResponse("set METRICS_TOKEN to scrape /metrics\n", status=403, content_type="text/plain")
    return HttpResponse(render(), content_type="text/plain; version=0.0.4; charset=utf-8")
