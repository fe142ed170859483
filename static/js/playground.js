// The playground talks to the public APIs with the key typed in, as any client would: the
// gateway's /v1/models and /v1/chat/completions, and the metering API's estimate and usage.
(() => {
  const $ = (id) => document.getElementById(id);
  const requestsUrl = document.currentScript.dataset.requests;
  const key = $("pg-key"), model = $("pg-model"), detail = $("pg-detail"), image = $("pg-image");
  const prompt = $("pg-prompt"), maxTokens = $("pg-max"), send = $("pg-send");
  let picture = null; // {file, url}
  let estimating = 0;
  let autoForImages = null; // what `auto` sends an image to, for this key

  const auth = () => ({Authorization: `Bearer ${key.value.trim()}`});
  const show = (id, text) => { $(id).textContent = text; };
  const money = (value, currency) => `${Number(value).toFixed(6)} ${currency || ""}`.trim();

  function problem(body, status) {
    // OpenAI-style {error: {message}}, or DRF's {detail} / {field: [messages]}.
    if (body && body.error && body.error.message) return body.error.message;
    if (body && body.detail) return body.detail;
    if (body && typeof body === "object") {
      return Object.entries(body).map(([name, messages]) => `${name}: ${[].concat(messages).join(" ")}`).join("; ");
    }
    return `the server answered ${status}`;
  }

  async function loadModels() {
    sessionStorage.setItem("playground-key", key.value.trim());
    model.disabled = true;
    show("pg-error", "");
    if (!key.value.trim()) return;
    const response = await fetch("/v1/models", {headers: auth()});
    const body = await response.json().catch(() => null);
    if (!response.ok) { show("pg-error", problem(body, response.status)); return; }
    const chosen = model.value;
    autoForImages = (body.data.find((m) => m.id === "auto") || {resolves_to: {}}).resolves_to.images;
    model.replaceChildren(...body.data.map((m) => new Option(
      m.id === "auto" ? `auto (images: ${m.resolves_to.images || "none"}, text: ${m.resolves_to.text || "none"})`
                      : `${m.id} (${m.modality})`, m.id)));
    if ([...model.options].some((o) => o.value === chosen)) model.value = chosen;
    model.disabled = false;
    estimate();
  }

  function textTokensGuess() {
    return Math.ceil(prompt.value.length / 4) + 20; // the estimate's text part; the answer gives the exact count
  }

  async function estimate() {
    const mine = ++estimating;
    if (!picture || model.disabled || !model.value) { show("pg-estimate", ""); return; }
    const tier = model.value === "auto" ? autoForImages : model.value;
    if (!tier) { show("pg-estimate", "No model takes images for this key."); return; }
    show("pg-estimate", "Estimating…");
    const form = new FormData();
    form.append("tier", tier);
    form.append("image", picture.file);
    if (detail.value !== "auto") form.append("detail", detail.value); // auto: the policy's own choice
    form.append("text_tokens", textTokensGuess());
    form.append("output_tokens", maxTokens.value || 0);
    const response = await fetch("/api/v1/estimate/", {method: "POST", headers: auth(), body: form});
    const body = await response.json().catch(() => null);
    if (mine !== estimating) return; // a newer choice is being estimated
    if (!response.ok) { show("pg-estimate", `Cannot send this image to ${tier}: ${problem(body, response.status)}`); return; }
    const sizes = body.sent_sizes.map(([w, h]) => `${w}×${h}`).join(", ");
    const tiles = body.sent_sizes.length > 1 ? ` (${body.sent_sizes.length} tiles)` : "";
    $("pg-estimate").innerHTML = "";
    const line = document.createElement("span");
    line.id = "pg-estimate-line";
    line.dataset.imageTokens = body.image_tokens;
    line.textContent = `${tier} receives it as ${sizes}${tiles}: ${body.image_tokens.toLocaleString()} image tokens. ` +
      `Estimated cost, with up to ${maxTokens.value} output tokens: ${money(body.cost, body.currency)}.`;
    $("pg-estimate").append(line);
  }

  function choose(file) {
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => { picture = {file, url: reader.result}; estimate(); };
    reader.readAsDataURL(file);
  }

  async function recordedCost(requestId) {
    // The usage event lands once the gateway's usage stream is ingested (a second or two).
    for (let attempt = 0; attempt < 40; attempt++) {
      const response = await fetch(`/api/v1/usage/requests/?request_id=${encodeURIComponent(requestId)}`, {headers: auth()});
      if (response.ok) {
        const body = await response.json();
        if (body.results && body.results.length) return body.results[0];
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
    return null;
  }

  async function chat() {
    show("pg-error", ""); show("pg-answer", ""); $("pg-usage").replaceChildren();
    if (!model.value) { show("pg-error", "Enter a key and choose a model first."); return; }
    const content = [{type: "text", text: prompt.value}];
    if (picture) content.push({type: "image_url", image_url: {url: picture.url, detail: detail.value}});
    send.disabled = true;
    show("pg-state", "Waiting for the first token…");
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: {...auth(), "Content-Type": "application/json"},
        body: JSON.stringify({model: model.value, max_tokens: Number(maxTokens.value) || 64, stream: true,
                              stream_options: {include_usage: true}, messages: [{role: "user", content}]}),
      });
      const requestId = response.headers.get("x-request-id");
      if (!response.ok) {
        show("pg-error", problem(await response.json().catch(() => null), response.status));
        return;
      }
      let usage = null, buffer = "";
      const reader = response.body.getReader(), decoder = new TextDecoder();
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, {stream: true});
        const events = buffer.split("\n\n");
        buffer = events.pop();
        for (const event of events) {
          const data = event.replace(/^data: /, "").trim();
          if (!data || data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) { show("pg-error", chunk.error.message); continue; }
          for (const choice of chunk.choices || []) $("pg-answer").textContent += (choice.delta && choice.delta.content) || "";
          if (chunk.usage) usage = chunk.usage;
          show("pg-state", "Answering…");
        }
      }
      show("pg-state", "");
      if (usage) showUsage(usage, requestId);
    } catch (error) {
      show("pg-error", `The request failed: ${error}`);
    } finally {
      send.disabled = false;
      if ($("pg-state").textContent !== "Recording…") show("pg-state", "");
    }
  }

  async function showUsage(usage, requestId) {
    const details = usage.prompt_tokens_details || {};
    const images = details.image_tokens || 0, cached = details.cached_tokens || 0;
    const line = document.createElement("p");
    line.id = "pg-usage-tokens";
    line.textContent = `Used: ${usage.prompt_tokens.toLocaleString()} prompt tokens (${(usage.prompt_tokens - images).toLocaleString()} text, ` +
      `${images.toLocaleString()} image${cached ? `, ${cached.toLocaleString()} from the prefix cache` : ""}), ` +
      `${usage.completion_tokens.toLocaleString()} output tokens.`;
    const cost = document.createElement("p");
    cost.id = "pg-usage-cost";
    cost.textContent = "Recording the cost…";
    $("pg-usage").append(line, cost);
    const event = requestId ? await recordedCost(requestId) : null;
    if (!event) { cost.textContent = "The cost is not recorded yet: see the request log in a moment."; return; }
    cost.textContent = `Cost recorded: ${money(event.cost, "")}${Number(event.cache_savings) ? ` (the cache saved ${money(event.cache_savings, "")})` : ""}. `;
    const link = document.createElement("a");
    link.href = `${requestsUrl}${encodeURIComponent(requestId)}/`;
    link.textContent = `Request ${requestId}`;
    cost.append(link);
  }

  // A key typed before this script ran is kept; otherwise the tab's last one.
  key.value = key.value || sessionStorage.getItem("playground-key") || "";
  key.addEventListener("change", loadModels);
  model.addEventListener("change", estimate);
  detail.addEventListener("change", estimate);
  maxTokens.addEventListener("change", estimate);
  image.addEventListener("change", () => choose(image.files[0]));
  const zone = $("pg-drop");
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => { e.preventDefault(); zone.classList.remove("over"); choose(e.dataTransfer.files[0]); });
  send.addEventListener("click", chat);
  if (key.value) loadModels();
})();
