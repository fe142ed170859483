from rest_framework.routers import SimpleRouter

from controlplane.benchmarks.api.views import ProfileViewSet, RunViewSet

router = SimpleRouter()
router.register("profiles", ProfileViewSet, basename="benchmark-profile")
router.register("runs", RunViewSet, basename="benchmark-run")
urlpatterns = router.urls
