// The playground talks to the public APIs as any client would, with a short-lived key the
// page gets from the reader's session: the gateway's /v1/models and /v1/chat/completions, and
// the metering API's estimate and usage. One conversation per model (two when comparing):
// each turn goes to both with the same input, each keeps its own answers.
(() => {
  const $ = (id) => document.getElementById(id);
  const script = document.currentScript.dataset;
  const tenant = $("pg-tenant"), model = $("pg-model"), compare = $("pg-compare"), detail = $("pg-detail");
  const image = $("pg-image"), prompt = $("pg-prompt"), maxTokens = $("pg-max"), send = $("pg-send");
  const system = $("pg-system"), temperature = $("pg-temperature"), topP = $("pg-top-p");
  let key = "";
  let pictures = []; // {file, url, name, width, height}
  let refused = ""; // why the images cannot be sent to a chosen model, or ""
  let estimating = 0;
  let autoForImages = null; // what `auto` sends an image to, for this tenant
  const threads = [[], []]; // each model's messages so far (without the system prompt)
  const imageNames = new Map(); // data URL -> the file's name, for the code view

  const show = (id, text) => { $(id).textContent = text; };
  // One request's amount, as the pages write it (the `money_each` filter): to the micro-unit,
  // thousands apart, followed by its currency.
  const money = (value, currency) => `${Number(value).toLocaleString("en-US", {minimumFractionDigits: 6, maximumFractionDigits: 6})} ${currency}`;
  const auth = () => ({Authorization: `Bearer ${key}`});
  const chosen = () => [model.value, compare.value].filter(Boolean);

  function problem(body, status) {
    // OpenAI-style {error: {message}}, or DRF's {detail} / {field: [messages]}.
    if (body && body.error && body.error.message) return body.error.message;
    if (body && typeof body.error === "string") return body.error;
    if (body && body.detail) return body.detail;
    if (body && typeof body === "object") {
      return Object.entries(body).map(([name, messages]) => `${name}: ${[].concat(messages).join(" ")}`).join("; ");
    }
    return `the server answered ${status}`;
  }

  async function takeKey() {
    // The page's key for the chosen tenant, from the session (made once an hour).
    const form = new FormData();
    form.append("tenant", tenant.value);
    const response = await fetch(script.keyUrl, {method: "POST", body: form, headers: {"X-CSRFToken": script.csrf}});
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new Error(problem(body, response.status));
    key = body.key;
  }

  async function loadModels() {
    model.disabled = compare.disabled = true;
    show("pg-error", "");
    try {
      await takeKey();
    } catch (error) { show("pg-error", `No key for ${tenant.value}: ${error.message}`); return; }
    const response = await fetch("/v1/models", {headers: auth()});
    const body = await response.json().catch(() => null);
    if (!response.ok) { show("pg-error", problem(body, response.status)); return; }
    const before = [model.value, compare.value];
    autoForImages = (body.data.find((m) => m.id === "auto") || {resolves_to: {}}).resolves_to.images;
    const label = (m) => (m.id === "auto" ? `auto (images: ${m.resolves_to.images || "none"}, text: ${m.resolves_to.text || "none"})`
                                          : `${m.id} (${m.modality})`);
    model.replaceChildren(...body.data.map((m) => new Option(label(m), m.id)));
    compare.replaceChildren(new Option("no other model", ""), ...body.data.map((m) => new Option(label(m), m.id)));
    if ([...model.options].some((o) => o.value === before[0])) model.value = before[0];
    if ([...compare.options].some((o) => o.value === before[1])) compare.value = before[1];
    model.disabled = compare.disabled = false;
    layout();
  }

  function layout() {
    chosen().forEach((name, index) => { $(`pg-thread-${index}`).querySelector(".pg-thread-model").textContent = name; });
    $("pg-thread-1").hidden = !compare.value;
    $("pg-threads").classList.toggle("pg-side-by-side", Boolean(compare.value));
    estimate();
    code();
  }

  function textTokensGuess() {
    return Math.ceil((prompt.value.length + system.value.length) / 4) + 20; // the answer gives the exact count
  }

  async function estimateOne(tier) {
    // What each image becomes on `tier` and what the turn may cost there (its output at max).
    let cost = 0, currency = "", tokens = 0;
    const lines = [];
    for (const [index, picture] of pictures.entries()) {
      const form = new FormData();
      form.append("tier", tier);
      form.append("image", picture.file);
      if (detail.value !== "auto") form.append("detail", detail.value); // auto: the policy's own choice
      form.append("text_tokens", index === 0 ? textTokensGuess() : 0);
      form.append("output_tokens", index === 0 ? (maxTokens.value || 0) : 0);
      const response = await fetch("/api/v1/estimate/", {method: "POST", headers: auth(), body: form});
      const body = await response.json().catch(() => null);
      if (!response.ok) return {refused: `Cannot send ${picture.name} to ${tier}: ${problem(body, response.status)}`};
      const sizes = body.sent_sizes.map(([w, h]) => `${w}×${h}`).join(", ");
      const tiles = body.sent_sizes.length > 1 ? ` in ${body.sent_sizes.length} tiles` : "";
      lines.push(`${picture.name} (${picture.width}×${picture.height}) → ${sizes}${tiles}, ${body.image_tokens.toLocaleString()} image tokens`);
      cost += Number(body.cost); currency = body.currency; tokens += body.image_tokens;
    }
    return {text: `${tier}: ${lines.join("; ")}. Up to ${money(cost, currency)} with ${maxTokens.value} output tokens.`, tokens};
  }

  async function estimate() {
    const mine = ++estimating;
    refused = "";
    send.disabled = false;
    if (!pictures.length || model.disabled) { show("pg-estimate", ""); return; }
    const tiers = chosen().map((name) => (name === "auto" ? autoForImages : name));
    if (tiers.some((tier) => !tier)) { refused = "No model takes images for this tenant."; }
    show("pg-estimate", refused || "Estimating…");
    if (refused) { send.disabled = true; return; }
    const found = [];
    for (const tier of tiers) found.push(await estimateOne(tier));
    if (mine !== estimating) return; // a newer choice is being estimated
    $("pg-estimate").replaceChildren();
    for (const [index, result] of found.entries()) {
      const line = document.createElement("div");
      line.className = "pg-estimate-line";
      if (index === 0) line.id = "pg-estimate-line";
      if (result.refused) { line.classList.add("error"); line.textContent = result.refused; refused = result.refused; } else {
        line.dataset.imageTokens = result.tokens;
        line.textContent = result.text;
      }
      $("pg-estimate").append(line);
    }
    send.disabled = Boolean(refused); // an image the policy refuses is never sent
  }

  function choose(files) {
    const reads = [...files].map((file) => new Promise((resolve) => {
      const reader = new FileReader();
      reader.onload = () => {
        const picture = new Image();
        picture.onload = () => resolve({file, url: reader.result, name: file.name || "image", width: picture.naturalWidth,
                                        height: picture.naturalHeight});
        picture.onerror = () => resolve({file, url: reader.result, name: file.name || "image", width: "?", height: "?"});
        picture.src = reader.result;
      };
      reader.readAsDataURL(file);
    }));
    Promise.all(reads).then((read) => {
      for (const picture of read) imageNames.set(picture.url, picture.name);
      pictures = pictures.concat(read); preview(); estimate(); code();
    });
  }

  function preview() {
    $("pg-preview").replaceChildren(...pictures.map((picture, index) => {
      const figure = document.createElement("figure");
      const img = document.createElement("img");
      img.src = picture.url; img.alt = picture.name;
      const caption = document.createElement("figcaption");
      caption.textContent = `${picture.name}, ${picture.width}×${picture.height} `;
      const remove = document.createElement("button");
      remove.type = "button"; remove.className = "secondary"; remove.textContent = "Remove";
      remove.addEventListener("click", () => { pictures.splice(index, 1); preview(); estimate(); code(); });
      caption.append(remove);
      figure.append(img, caption);
      return figure;
    }));
  }

  function userTurn() {
    const content = [{type: "text", text: prompt.value}];
    for (const picture of pictures) content.push({type: "image_url", image_url: {url: picture.url, detail: detail.value}});
    return {role: "user", content};
  }

  function body(name, messages, stream) {
    const request = {model: name, max_tokens: Number(maxTokens.value) || 64};
    if (temperature.value !== "") request.temperature = Number(temperature.value);
    if (topP.value !== "") request.top_p = Number(topP.value);
    request.messages = [...(system.value.trim() ? [{role: "system", content: system.value}] : []), ...messages];
    if (stream) Object.assign(request, {stream: true, stream_options: {include_usage: true}});
    return request;
  }

  function code() {
    // The next request to the first model, its images named by file instead of inlined.
    if (!model.value) return;
    const names = new Map();
    const messages = [...threads[0], userTurn()].map((message) => (typeof message.content === "string" ? message : {
      ...message, content: message.content.map((part) => {
        if (part.type !== "image_url") return part;
        if (!names.has(part.image_url.url)) {
          names.set(part.image_url.url, imageNames.get(part.image_url.url) || `image-${names.size + 1}.jpg`);
        }
        return {...part, image_url: {...part.image_url, url: `@@${names.get(part.image_url.url)}@@`}};
      }),
    }));
    const request = body(model.value, messages, false);
    const json = JSON.stringify(request, null, 2);
    const origin = window.location.origin;
    const files = [...names.values()];
    $("pg-code-curl").textContent = [
      ...files.map((name, index) => `IMAGE_${index + 1}="data:image/jpeg;base64,$(base64 -w0 '${name}')"`),
      `curl ${origin}/v1/chat/completions \\`, `  -H "Authorization: Bearer $VLM_API_KEY" \\`,
      `  -H "Content-Type: application/json" \\`,
      `  -d "$(cat <<JSON`, files.reduce((text, name, index) => text.split(`"@@${name}@@"`).join(`"$IMAGE_${index + 1}"`), json),
      "JSON", `)"`,
    ].join("\n");
    const python = files.reduce((text, name) => text.split(`"@@${name}@@"`).join(`image(${JSON.stringify(name)})`),
      JSON.stringify(request.messages, null, 4));
    const options = Object.entries(request).filter(([name]) => !["model", "messages"].includes(name))
      .map(([name, value]) => `    ${name}=${JSON.stringify(value)},`);
    $("pg-code-python").textContent = [
      "import base64", "import os", "", "import openai", "",
      `client = openai.OpenAI(base_url="${origin}/v1", api_key=os.environ["VLM_API_KEY"])`, "",
      "def image(path):", '    return "data:image/jpeg;base64," + base64.b64encode(open(path, "rb").read()).decode()', "",
      "response = client.chat.completions.create(", `    model=${JSON.stringify(request.model)},`, ...options,
      `    messages=${python.split("\n").join("\n    ")},`, ")", "print(response.choices[0].message.content)",
    ].join("\n");
  }

  function turnView(index, role, text) {
    const turn = document.createElement("div");
    turn.className = `pg-turn pg-${role}`;
    const who = document.createElement("strong");
    who.textContent = role === "user" ? "You" : "Answer";
    const said = document.createElement("pre");
    said.className = "answer";
    said.textContent = text;
    turn.append(who, said);
    $(`pg-thread-${index}`).querySelector(".pg-turns").append(turn);
    return turn;
  }

  async function recordedCost(requestId) {
    // The usage event lands once the gateway's usage stream is ingested (a second or two).
    for (let attempt = 0; attempt < 40; attempt++) {
      const response = await fetch(`/api/v1/usage/requests/?request_id=${encodeURIComponent(requestId)}`, {headers: auth()});
      if (response.ok) {
        const found = await response.json();
        if (found.results && found.results.length) return found.results[0];
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
    return null;
  }

  async function ask(index, name, turn) {
    // One model's answer to the turn, streamed into its conversation (the first model's latest
    // answer and its figures carry the ids).
    if (index === 0) for (const id of ["pg-answer", "pg-usage-tokens", "pg-usage-cost"]) $(id)?.removeAttribute("id");
    const view = turnView(index, "assistant", "");
    const answer = view.querySelector("pre");
    if (index === 0) answer.id = "pg-answer";
    const messages = [...threads[index], turn];
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: {...auth(), "Content-Type": "application/json"}, body: JSON.stringify(body(name, messages, true)),
    });
    const requestId = response.headers.get("x-request-id");
    if (!response.ok) {
      view.classList.add("error");
      answer.textContent = problem(await response.json().catch(() => null), response.status);
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
        if (chunk.error) { view.classList.add("error"); answer.textContent += chunk.error.message; continue; }
        for (const choice of chunk.choices || []) answer.textContent += (choice.delta && choice.delta.content) || "";
        if (chunk.usage) usage = chunk.usage;
      }
    }
    threads[index] = [...messages, {role: "assistant", content: answer.textContent}];
    if (usage) showUsage(view, index, usage, requestId);
  }

  async function showUsage(view, index, usage, requestId) {
    const details = usage.prompt_tokens_details || {};
    const images = details.image_tokens || 0, cached = details.cached_tokens || 0;
    const line = document.createElement("p");
    line.className = "muted pg-usage-tokens";
    if (index === 0) line.id = "pg-usage-tokens";
    line.textContent = `Used: ${usage.prompt_tokens.toLocaleString()} prompt tokens (${(usage.prompt_tokens - images).toLocaleString()} text, ` +
      `${images.toLocaleString()} image${cached ? `, ${cached.toLocaleString()} from the prefix cache` : ""}), ` +
      `${usage.completion_tokens.toLocaleString()} output tokens.`;
    const cost = document.createElement("p");
    cost.className = "muted";
    if (index === 0) cost.id = "pg-usage-cost";
    cost.textContent = "Recording the cost…";
    view.append(line, cost);
    const event = requestId ? await recordedCost(requestId) : null;
    if (!event) { cost.textContent = "The cost is not recorded yet: see the request log in a moment."; return; }
    cost.textContent = `Cost recorded: ${money(event.cost, event.currency)}${Number(event.cache_savings) ? ` (the cache saved ${money(event.cache_savings, event.currency)})` : ""}. `;
    const link = document.createElement("a");
    link.href = `${script.requests}${encodeURIComponent(requestId)}/`;
    link.textContent = `Request ${requestId}`;
    cost.append(link);
  }

  async function chat() {
    show("pg-error", "");
    if (!model.value) { show("pg-error", "Choose a model first."); return; }
    if (refused) { show("pg-error", refused); return; }
    const sent = userTurn();
    send.disabled = true;
    show("pg-state", "Answering…");
    try {
      chosen().forEach((name, index) => {
        turnView(index, "user", prompt.value + (pictures.length ? `\n[${pictures.map((p) => p.name).join(", ")}]` : ""));
      });
      await Promise.all(chosen().map((name, index) => ask(index, name, sent)));
      pictures = []; preview(); show("pg-estimate", "");
      prompt.value = "";
    } catch (error) {
      show("pg-error", `The request failed: ${error}`);
    } finally {
      send.disabled = false;
      show("pg-state", "");
      code();
    }
  }

  function restart() {
    threads[0] = []; threads[1] = [];
    document.querySelectorAll(".pg-turns").forEach((turns) => turns.replaceChildren());
    code();
  }

  tenant.addEventListener("change", () => { restart(); loadModels(); });
  model.addEventListener("change", () => { restart(); layout(); });
  compare.addEventListener("change", () => { restart(); layout(); });
  for (const input of [detail, maxTokens]) input.addEventListener("change", () => { estimate(); code(); });
  for (const input of [system, temperature, topP, prompt]) input.addEventListener("input", code);
  image.addEventListener("change", () => { choose(image.files); image.value = ""; });
  const zone = $("pg-drop");
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => { e.preventDefault(); zone.classList.remove("over"); choose(e.dataTransfer.files); });
  send.addEventListener("click", chat);
  $("pg-new").addEventListener("click", restart);
  $("pg-code-toggle").addEventListener("click", () => {
    const shown = $("pg-code").hidden;
    $("pg-code").hidden = !shown;
    $("pg-code-toggle").setAttribute("aria-expanded", String(shown));
    code();
  });
  if (tenant.value) loadModels();
})();
