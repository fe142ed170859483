"""Whatever a user puts in a page's query string, form or address, or a caller in an API's,
the answer is a page, a form error or a 4xx: never a 500, and never a reply a server cannot
send. Every route of the URLconf is fuzzed as each role that may open it, with the fields its
pages show and the parameters the OpenAPI schema documents, so a new page is covered without
a change here.

Each form is sent with every field holding one value of each kind that has broken a page
(ALWAYS), then with values hypothesis makes up; each field written in (not chosen) is sent
alone with the values that pass a form's checks and break what comes after (DEEP), the rest
of its form as the page fills it in."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import pytest
from django.conf import settings as django_settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import Resolver404, URLPattern, URLResolver, get_resolver, resolve
from django.urls.resolvers import RegexPattern
from django.utils import timezone
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from tests.images import image_bytes
from tests.pages import Form, page_forms_and_links

pytestmark = pytest.mark.django_db

# Django's own admin, and the gateway (fuzzed in tests/controlplane/gateway), are not pages of ours.
NOT_OURS = ("admin/", "v1/")
# The tenant admin is alice's, and the tenant key alice's too (on the API only); nobody is signed out.
ROLES = ("operator", "finance", "tenant admin", "tenant key", "nobody")
# What a page may read without a field for it.
COMMON_NAMES = ("page", "after", "format", "limit", "offset", "tenant", "tier", "since", "until", "month",
                "from", "to", "period", "q", "key", "status", "version", "lang")
# Numbers a form takes that what follows may not, and moments that overflow once moved to UTC.
DEEP_NUMBERS = ("-1", "9" * 30)
DEEP = (*DEEP_NUMBERS, "9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+12:00")
# ...and the last day (the day after it overflows), a NUL byte, digits that are not ASCII, a
# value past any length.
ALWAYS = (*DEEP, "9999-12-31", "a\x00b", "١٢", "x" * 300)
EXTRA_EXAMPLES = 1

ODD = ["9999-12-31 23:59", "0001-01-01", "9999-12", "0000-00-00", "2026-02-30", "2026-13-01", "10000-01-01",
       "0", "1e999", "NaN", "inf", "-" + "9" * 25, "0x1f", "１２", "\x00", "", " ", "null", "[]", "{}",
       "../../etc/passwd", "<script>", "'; --", "\u202e", "e\u0301", "😀"]
moments = st.builds(
    lambda when, minutes, form: form(when.replace(tzinfo=dt.timezone(dt.timedelta(minutes=minutes)))),
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59)),
    st.integers(-(23 * 60 + 59), 23 * 60 + 59),
    st.sampled_from([dt.datetime.isoformat, lambda d: d.strftime("%Y-%m-%d %H:%M"), lambda d: d.date().isoformat(),
                     lambda d: d.strftime("%Y-%m"), lambda d: d.replace(tzinfo=None).isoformat()]),
)
values = st.one_of(st.sampled_from(ODD), moments, st.integers(-(10**30), 10**30).map(str), st.floats().map(str),
                   st.text(st.characters(exclude_categories=("Cs",)), max_size=40))
FUZZED = "<fuzzed>"  # where in a path the value goes


@dataclass(frozen=True)
class Route:
    template: str  # as the URLconf writes it, e.g. "keys/<int:pk>/revoke/"
    converters: dict  # name: Django's converter (None for a DRF router's [^/.]+)


def _routes(patterns, prefix="") -> list[Route]:
    routes = []
    for pattern in patterns:
        template = prefix + str(pattern.pattern)
        if template.startswith(NOT_OURS):
            continue
        if isinstance(pattern, URLResolver):
            routes += _routes(pattern.url_patterns, template)
        elif isinstance(pattern, URLPattern):
            converters = {**getattr(pattern.pattern, "converters", {})}
            if isinstance(pattern.pattern, RegexPattern):  # a DRF router's, such as ^runs/(?P<pk>[^/.]+)/$
                group = r"\(\?P<(\w+)>\[\^/\.\]\+\)"
                converters.update(dict.fromkeys(re.findall(group, template)))
                template = re.sub(group, r"<\1>", template).replace("^", "").replace("$", "")
            if not re.search(r"[()\[\]*+?\\]", template):  # a catch-all is no page of its own
                routes.append(Route(template, converters))
    return routes


ROUTES = _routes(get_resolver().url_patterns)


@dataclass(frozen=True)
class Target:
    """What is fuzzed: the `names` of a query or form (`rest` filled in as its page does, with
    a picture in each of its `files`), or the FUZZED part of the path. `deep`: the values to
    send a field alone."""

    role: str
    method: str
    path: str
    names: tuple = ()
    rest: tuple = ()  # (name, value) pairs
    files: tuple = ()
    deep: tuple = DEEP


class Visitor:
    """The test client as one role at a time, signed in again when a request signed it out."""

    def __init__(self, client, world):
        self.client, self.world, self.role = client, world, None

    def request(self, role: str, method: str, path: str, data: dict | None = None):
        users = {"operator": self.world.operator, "finance": self.world.finance, "tenant admin": self.world.alice_admin}
        cookie = self.client.cookies.get(django_settings.SESSION_COOKIE_NAME)
        if role != self.role or (role in users and not (cookie and cookie.value)):
            self.client.logout()
            if role in users:
                self.client.force_login(users[role])
            self.role = role
        headers = {"HTTP_AUTHORIZATION": f"Bearer {self.world.alice_key}"} if role == "tenant key" else {}
        return getattr(self.client, method)(path, data or {}, **headers)


@pytest.fixture
def fuzz_world(world):
    """The world, with one of each thing a page shows: a request, an engine, a rule, a webhook,
    routing rules (a default one and alice's), a benchmark profile with its run, an evaluation
    set with its item and an import."""
    from controlplane.alerts.models import AlertRule, Webhook
    from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
    from controlplane.fleet.models import EngineInstance, Node
    from controlplane.metering.records import UsageRecord
    from controlplane.metering.services import usage_record

    usage_record(record=UsageRecord(request_id="req-1", tenant_id=world.alice.pk,
                                    api_key_id=world.alice.api_keys.get().pk, tier_id=world.vision.pk,
                                    text_tokens=30, output_tokens=8))
    node = Node.objects.create(name="local", queue="node.local", last_seen_at=timezone.now())
    EngineInstance.objects.create(tier=world.vision, node=node, port=8100)
    AlertRule.objects.create(name="quota", kind="quota_use", threshold=80)
    Webhook.objects.create(name="hook", url="http://127.0.0.1:9/hooks/none")
    from controlplane.tenants.models import RoutingRule

    RoutingRule.objects.create(tier=world.vision, tasks="receipt", escalate_to=world.vision, escalate_detail="high",
                               threshold=0.5)
    RoutingRule.objects.create(tenant=world.alice, tier=world.vision, min_images=1, pixel_cap=500_000)
    profile = BenchmarkProfile.objects.create(name="smoke", tier=world.vision, sweep=[2],
                                              image_buckets=[{"width": 640, "height": 480, "weight": 1}])
    BenchmarkRun.objects.create(profile=profile)
    from controlplane.benchmarks.models import EvalImport, EvalItem, EvalSet

    eval_set = EvalSet.objects.create(name="reading", source="imported", file_name="reading.jsonl")
    EvalItem.objects.create(eval_set=eval_set, row=1, task_type="read", question="What is written?", answers=["42"],
                            content_type="image/jpeg", width=16, height=16, data=image_bytes(16, 16))
    EvalImport.objects.create(name="reading", file_name="reading.jsonl", task_type="read", state="failed",
                              errors=[[2, "question is empty"]], error_count=1)
    return world


def _known() -> list[str]:
    """Ids and names of what exists, for the parts of a path no page links to."""
    from django.apps import apps

    found = []
    for model in apps.get_models():
        if model.__module__.startswith("controlplane."):
            found += [str(pk) for pk in model.objects.order_by("pk").values_list("pk", flat=True)[:2]]
            if any(f.name == "name" for f in model._meta.fields):
                found += model.objects.order_by("pk").values_list("name", flat=True)[:2]
    return list(dict.fromkeys(found))


@pytest.fixture(scope="session")
def api_parameters() -> dict[str, tuple[set, set]]:
    """Per path of the OpenAPI schema (its parts written {}): its query parameters, and the
    fields of its bodies."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    found = {}
    for path, operations in schema["paths"].items():
        query, body = set(), set()
        for operation in operations.values():
            query.update(p["name"] for p in operation.get("parameters", []) if p["in"] == "query")
            for content in operation.get("requestBody", {}).get("content", {}).values():
                reference = content.get("schema", {}).get("$ref", "")
                body.update(schema["components"]["schemas"].get(reference.rsplit("/", 1)[-1], {})
                            .get("properties", {}))
        found[re.sub(r"\{\w+\}", "{}", path)] = (query, body)
    return found


def _route_of(url: str) -> tuple[str, dict] | None:
    try:
        match = resolve(urlsplit(url).path)
    except Resolver404:
        return None
    route = re.sub(r"\(\?P<(\w+)>\[\^/\.\]\+\)", r"<\1>", match.route).replace("^", "").replace("$", "")
    return route, match.kwargs


def _refused(response) -> bool:
    return response.status_code in (401, 403) or (
        response.status_code == 302 and response["Location"].startswith(f"/{django_settings.LOGIN_URL}"))


def _probe(visitor, role, path) -> tuple[object, bool]:
    """The route's answer to the role, and whether it is sent forms only."""
    response = visitor.request(role, "get", path)
    if response.status_code == 405:
        return visitor.request(role, "post", path), True
    return response, False


def _crawl(visitor, role, route: Route) -> tuple[list[str], dict, list[tuple[str, Form]]]:
    """From the nearest page above the route, the pages on the way down to it: the addresses
    that lead to the route, the values they give its path's parts, and the forms sent to it."""
    parts = route.template.split("/")
    queue = ["/" + "/".join(parts[:n]) + ("/" if n else "") for n in range(len(parts) - 1, -1, -1)
             if "<" not in "/".join(parts[:n])]
    seen, exact, bound, forms = set(), [], {}, []
    while queue and not exact and len(seen) < 6:
        page = queue.pop(0)
        if page in seen:
            continue
        seen.add(page)
        response = visitor.request(role, "get", page)
        if response.status_code != 200 or "html" not in response.get("Content-Type", ""):
            continue
        found, links = page_forms_and_links(response.content.decode())
        for url, form in [(link, None) for link in links] + [(f.action or page, f) for f in found]:
            matched = _route_of(url)
            if matched is None or not route.template.startswith(matched[0]):
                continue
            for name, value in matched[1].items():
                bound.setdefault(name, str(value))
            if matched[0] == route.template:
                exact.append(urlsplit(url).path)
                if form is not None:
                    forms.append((urlsplit(url).path, form))
            elif form is None and matched[0]:
                queue.append(urlsplit(url).path)
    return exact, bound, forms


def _path(visitor, role, route: Route, bound: dict) -> str:
    """An address of the route that finds something, if any: the values its pages gave, else
    those of things that exist."""
    known = _known() if set(route.converters) - set(bound) else []
    filled = {name: bound.get(name) or known[0] for name in route.converters}
    for name in set(route.converters) - set(bound):
        for value in known[:12]:
            filled[name] = value
            if _probe(visitor, role, _written(route, filled))[0].status_code != 404:
                break
    return _written(route, filled)


def _written(route: Route, values: dict) -> str:
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: values[m.group(1)], route.template)


def _parts(route: Route, path: str) -> dict[str, str]:
    pieces = re.split(r"<(?:\w+:)?\w+>", "/" + route.template)
    return dict(zip(route.converters, re.fullmatch("([^/]+)".join(map(re.escape, pieces)), path).groups(),
                    strict=True))


def _plan(visitor, route: Route, api_parameters: dict) -> tuple[list[Target], list[Target]]:
    """What to send every field at once (as each role that may open the route), and what to
    send each written-in field alone (as the first role whose page has it)."""
    together, alone, api = [], {}, route.template.startswith("api/")
    for role in ROLES:
        if role == "tenant key" and not api:
            continue
        exact, bound, forms = _crawl(visitor, role, route) if route.converters else ([], {}, [])
        path = exact[0] if exact else _path(visitor, role, route, bound)
        response, forms_only = _probe(visitor, role, path)
        if _refused(response):
            alone.setdefault((role, path), Target(role, "get", path, ("q",), deep=DEEP[:1]))  # once is enough
            continue
        if forms_only and not route.converters:
            forms = _crawl(visitor, role, route)[2]  # a form on another page is sent to it
        if response.status_code == 200 and "html" in response.get("Content-Type", ""):
            forms += [(path, f) for f in page_forms_and_links(response.content.decode())[0]
                      if not f.action or (_route_of(f.action) or ("",))[0] == route.template]
        if api:
            query, body = api_parameters.get(re.sub(r"<(?:\w+:)?\w+>", "{}", "/" + route.template), ((), ()))
            forms += [(path, Form("", "get", dict.fromkeys(query, []), typed=dict.fromkeys(query, "text"))),
                      (path, Form("", "post", dict.fromkeys(body, []), typed=dict.fromkeys(body, "text")))]
        if not any(target.names == COMMON_NAMES for target in together):  # what no field asks for: once
            forms.append((path, Form("", "post" if forms_only else "get", dict.fromkeys(COMMON_NAMES, []))))
        for form_path, form in forms:
            if not form.fields and not form.files:
                continue  # a button: the names no field asks for are sent to it
            rest = tuple(form.as_sent().items())
            together.append(Target(role, form.method, form_path, tuple(form.fields), rest, tuple(form.files)))
            for name, kind in form.typed.items():
                alone.setdefault((form.method, form_path, name), Target(
                    role, form.method, form_path, (name,), rest, tuple(form.files),
                    DEEP_NUMBERS if kind == "number" else DEEP))
        for name in route.converters:
            parts = {**_parts(route, path), name: FUZZED}
            together.append(Target(role, "post" if forms_only else "get", _written(route, parts)))
    return list(dict.fromkeys(together)), list(alone.values())


def _send(visitor, target: Target, values: dict):
    data = dict(target.rest)
    data.update(values)
    path = target.path.replace(FUZZED, quote(values.get(FUZZED, ""), safe="") or "-")
    data.pop(FUZZED, None)
    if target.method == "post":
        picture = image_bytes(8, 8, "PNG")
        data.update({name: SimpleUploadedFile("a.png", data.pop(name, "").encode() or picture)
                     for name in target.files})
    return visitor.request(target.role, target.method, path, data)


def _assert_a_reply_a_server_can_send(response) -> None:
    assert response.status_code < 500, response.content[:500]
    for name, value in response.items():
        # A control character in a header makes the server drop the reply: the client sees nothing.
        assert not re.search(r"[\x00-\x1f\x7f]", value), (name, value)
    if response.streaming:
        b"".join(response.streaming_content)  # an error while streaming cuts the file short


def _fuzz_together(visitor, target: Target) -> None:
    names = (*target.names, *target.files) or (FUZZED,)

    @settings(max_examples=EXTRA_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(sent=st.fixed_dictionaries(dict.fromkeys(names, values)))
    def each(sent):
        note(f"{target} sent {sent!r}")
        _assert_a_reply_a_server_can_send(_send(visitor, target, sent))

    for value in ALWAYS:
        each = example(sent=dict.fromkeys(names, value))(each)
    each()


@pytest.mark.parametrize("route", ROUTES, ids=lambda route: route.template or "/")
def test_no_parameter_of_any_page_or_api_makes_it_fail(client, fuzz_world, api_parameters, route):
    visitor = Visitor(client, fuzz_world)
    together, alone = _plan(visitor, route, api_parameters)
    for target in together:
        _fuzz_together(visitor, target)
    for target in alone:
        for value in target.deep:
            try:
                _assert_a_reply_a_server_can_send(_send(visitor, target, {target.names[0]: value}))
            except Exception as exc:
                exc.add_note(f"{target} sent {value!r}")
                raise
