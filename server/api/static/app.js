// mlxpipe's page: a streaming chat over /v1/chat/completions and a live view of /health.
"use strict";

const $ = (id) => document.getElementById(id);

// -- chat ---------------------------------------------------------------------

const history = [];          // the user/assistant turns, sent whole with every request
let controller = null;       // the AbortController of the reply being streamed

function bubble(role, text = "") {
  const list = $("messages");
  list.querySelector(".empty")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  list.append(el);
  scrollDown(true);
  return el;
}

function scrollDown(force = false) {
  const list = $("messages");
  const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  if (force || nearBottom) list.scrollTop = list.scrollHeight;
}

// Headers for the API: the key, when the server wants one (kept in this browser only).
function authHeaders() {
  const key = $("api_key").value.trim();
  localStorage.setItem("mlxpipe.api_key", key);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The request body: the conversation, and only the settings that are filled in.
function requestBody() {
  const system = $("system").value.trim();
  const body = {
    model: "default",
    stream: true,
    messages: system ? [{ role: "system", content: system }, ...history] : [...history],
  };
  for (const [key, parse] of [["temperature", parseFloat], ["top_p", parseFloat],
                              ["top_k", parseInt], ["max_tokens", parseInt], ["seed", parseInt]]) {
    const raw = $(key).value.trim();
    if (raw !== "" && !Number.isNaN(parse(raw))) body[key] = parse(raw);
  }
  if (body.top_k === 0) delete body.top_k;   // 0 means off
  const stops = $("stop_strings").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stops.length) body.stop = stops;
  return body;
}

// Yields the JSON objects of a server-sent event stream, until `data: [DONE]`.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function setStreaming(on) {
  $("send").disabled = on;
  $("clear").disabled = on;
  $("stop").disabled = !on;
  document.body.classList.toggle("streaming", on);
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  const userEl = bubble("user", text);
  history.push({ role: "user", content: text });
  const reply = bubble("assistant pending");
  let answer = "";
  let failure = null;

  controller = new AbortController();
  setStreaming(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        answer += delta;
        reply.textContent = answer;
        scrollDown();
      }
    }
  } catch (err) {
    failure = err.name === "AbortError" ? null : err.message;
    if (err.name === "AbortError") reply.dataset.note = "stopped";
  } finally {
    controller = null;
    setStreaming(false);
    reply.classList.remove("pending");
  }

  if (answer) {
    history.push({ role: "assistant", content: answer });
  } else {
    reply.remove();
    history.pop();                       // a turn without a reply is not kept
    userEl.classList.add("unsent");
  }
  if (failure) bubble("error", failure);
  $("prompt").focus();
}

function clearChat() {
  history.length = 0;
  $("messages").innerHTML = '<p class="empty">Conversation cleared.</p>';
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", clearChat);

// -- cluster view -----------------------------------------------------------------

const MB = 1e6;
const rows = new Map();      // stage index -> its card's elements

function stageCard() {
  const el = document.createElement("div");
  el.className = "stage";
  el.innerHTML = `
    <div class="stage-head">
      <span class="index"></span> <span class="layers"></span>
      <span class="state"></span>
    </div>
    <div class="address"></div>
    <div class="bar"><div class="fill"></div></div>
    <dl class="figures">
      <div><dt>busy</dt><dd class="busy"></dd></div>
      <div><dt>tok/s</dt><dd class="tps"></dd></div>
      <div><dt>queue</dt><dd class="queue"></dd></div>
      <div><dt>seqs</dt><dd class="seqs"></dd></div>
      <div><dt>memory</dt><dd class="memory"></dd></div>
      <div><dt>prefix cache</dt><dd class="prefix"></dd></div>
      <div><dt>cache hits</dt><dd class="hits"></dd></div>
    </dl>`;
  const part = (cls) => el.querySelector(`.${cls}`);
  return { el, index: part("index"), layers: part("layers"), state: part("state"),
           address: part("address"), fill: part("fill"), busy: part("busy"), tps: part("tps"),
           queue: part("queue"), seqs: part("seqs"), memory: part("memory"), prefix: part("prefix"),
           hits: part("hits") };
}

function renderStage(row, s) {
  const reachable = s.state !== "unreachable";
  const busy = reachable ? Math.round((s.busy_fraction || 0) * 100) : null;
  const dash = (v) => (reachable ? v : "–");
  row.el.dataset.state = s.state;
  row.index.textContent = `Stage ${s.stage}`;
  row.layers.textContent = `[${s.layers[0]}, ${s.layers[1]})`;
  row.state.textContent = s.state;
  row.address.textContent = s.address;
  row.fill.style.width = `${busy ?? 0}%`;
  row.busy.textContent = busy === null ? "–" : `${busy}%`;
  row.tps.textContent = dash((s.tokens_per_s ?? 0).toFixed(1));
  row.queue.textContent = dash(s.queue_depth);
  row.seqs.textContent = dash(s.live_sequences);
  row.memory.textContent = dash(`${(((s.weight_bytes || 0) + (s.cache_bytes || 0)) / MB).toFixed(1)} MB`);
  row.prefix.textContent = dash(`${((s.prefix_cache_bytes || 0) / MB).toFixed(1)} MB`);
  row.hits.textContent = dash(`${Math.round((s.prefix_hit_rate || 0) * 100)}%`);
}

function renderHealth(h) {
  $("model").textContent = h.model;
  setStatus(h.status, h.status === "ok" ? "ready" : "unavailable");
  $("live-requests").textContent = `· ${h.live_requests} live request${h.live_requests === 1 ? "" : "s"}`;
  $("reason").hidden = !h.reason;
  $("reason").textContent = h.reason || "";

  if (rows.size !== h.stages.length) {
    rows.clear();
    $("stages").replaceChildren();
  }
  for (const s of h.stages) {
    if (!rows.has(s.stage)) {
      rows.set(s.stage, stageCard());
      $("stages").append(rows.get(s.stage).el);
    }
    renderStage(rows.get(s.stage), s);
  }
}

function setStatus(status, text) {
  $("cluster-status").dataset.status = status;
  $("cluster-status").textContent = text;
}

async function poll() {
  try {
    const response = await fetch("/health", { cache: "no-store", headers: authHeaders() });
    if (response.status === 401) {
      setStatus("offline", "this server needs an API key (settings)");
      setTimeout(poll, 1000);
      return;
    }
    const health = await response.json();    // 200 and 503 both carry the full body
    if (!Array.isArray(health.stages)) throw new Error(`unexpected /health reply ${response.status}`);
    renderHealth(health);
    $("stages").classList.remove("stale");
  } catch {
    setStatus("offline", "head unreachable");
    $("stages").classList.add("stale");      // the last figures, greyed out
  }
  setTimeout(poll, 1000);
}

$("api_key").value = localStorage.getItem("mlxpipe.api_key") || "";
poll();
