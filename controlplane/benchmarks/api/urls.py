from rest_framework.routers import SimpleRouter

from controlplane.benchmarks.api.views import EvalSetViewSet, ProfileViewSet, RunViewSet

router = SimpleRouter()
router.register("profiles", ProfileViewSet, basename="benchmark-profile")
router.register("runs", RunViewSet, basename="benchmark-run")
router.register("eval-sets", EvalSetViewSet, basename="benchmark-eval-set")
urlpatterns = router.urls
