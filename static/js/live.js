// A page part marked data-live="N" is fetched again every N seconds and swapped in place: the
// figures stay current without reloading the page (scroll, focus and half-typed input stay).
(() => {
  const part = document.querySelector("[data-live]");
  if (!part) return;
  const every = Math.max(2, Number(part.dataset.live) || 5) * 1000;
  const busy = () => part.contains(document.activeElement) && document.activeElement.matches("input, select, textarea");
  async function refresh() {
    if (document.hidden || busy()) return;
    try {
      const response = await fetch(window.location.href, {headers: {"X-Requested-With": "fetch"}, credentials: "same-origin"});
      if (!response.ok || response.redirected) return;
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html").querySelector("[data-live]");
      if (fresh) part.innerHTML = fresh.innerHTML;
    } catch (error) { /* the server is away for a moment: try again next time */ }
  }
  setInterval(refresh, every);
})();
