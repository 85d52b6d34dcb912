// The live cluster view: /health read every second, one card per stage, the
// speculation figures and a chart of the tokens the head generated per second.

const $ = (id) => document.getElementById(id);
const MB = 1e6;
const WINDOW_S = 300;        // the chart's longest span (it starts at 60 s and grows with the page's age)
const MIN_SPAN_S = 60;
const POLL_MS = 1000;

const cards = new Map();     // stage index -> its card's elements
const rates = [];            // [{t: ms, rate: generated tok/s since the previous reading}]
let previous = null;         // {t, tokens} of the last reading

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
      <div title="bytes of the prefix cache's blocks in memory"><dt>prefix</dt><dd class="prefix"></dd></div>
      <div title="bytes of the prefix cache's blocks on the stage's disk, of what it may hold"><dt>prefix disk</dt><dd class="disk"></dd></div>
      <div title="prompt positions taken from the prefix cache, of all prompt positions"><dt>prefix hits</dt><dd class="hits"></dd></div>
    </dl>
    <div class="group" title="a tensor-parallel group: the ranks that split every layer of this stage, and what their all-reduces cost a token"></div>`;
  const part = (cls) => el.querySelector(`.${cls}`);
  return { el, ...Object.fromEntries(["index", "layers", "state", "address", "fill", "busy", "tps", "queue", "seqs",
                                       "memory", "prefix", "disk", "hits", "group"].map((cls) => [cls, part(cls)])) };
}

function renderStage(card, s) {
  const reachable = s.state !== "unreachable";
  // A key that is not an operator's gets no activity figures (busy, queue, caches): shown as a dash.
  const has = (key) => reachable && s[key] !== undefined;
  const busy = has("busy_fraction") ? Math.round(s.busy_fraction * 100) : null;
  const dash = (key, v) => (has(key) ? v() : "–");
  card.el.dataset.state = s.state;
  card.index.textContent = `Stage ${s.stage}`;
  card.layers.textContent = `[${s.layers[0]}, ${s.layers[1]})`;
  card.state.textContent = s.state;
  card.address.textContent = s.address;
  card.fill.style.width = `${busy ?? 0}%`;
  card.busy.textContent = busy === null ? "–" : `${busy}%`;
  card.tps.textContent = dash("tokens_per_s", () => s.tokens_per_s.toFixed(1));
  card.queue.textContent = dash("queue_depth", () => s.queue_depth);
  card.seqs.textContent = dash("live_sequences", () => s.live_sequences);
  card.memory.textContent = dash("weight_bytes",
    () => `${(((s.weight_bytes || 0) + (s.cache_bytes || 0)) / MB).toFixed(1)} MB`);
  card.prefix.textContent = dash("prefix_cache_bytes", () => `${(s.prefix_cache_bytes / MB).toFixed(1)} MB`);
  card.disk.textContent = dash("prefix_disk_limit_bytes", () => (s.prefix_disk_limit_bytes
    ? `${((s.prefix_disk_bytes || 0) / MB).toFixed(1)} of ${(s.prefix_disk_limit_bytes / MB).toFixed(0)} MB` : "off"));
  card.hits.textContent = dash("prefix_hit_rate", () => `${Math.round(s.prefix_hit_rate * 100)}%`);
  const g = s.group;
  card.group.textContent = g ? `group of ${g.size}: ` + g.ranks.map((r) => `${r.rank} ${r.address} ${r.state}`).join(", ") +
    `; all-reduces ${g.allreduce_ms_per_token.toFixed(2)} ms a token` : "";
  card.group.hidden = !g;
}

function renderSpeculation(spec) {
  const el = $("speculation");
  if (!spec || !spec.drafted_tokens) {
    el.textContent = "no drafts judged yet";
    return;
  }
  const sources = Object.entries(spec.by_source || {})
    .map(([source, s]) => `${source} ${Math.round((s.acceptance || 0) * 100)}%`).join(", ");
  el.textContent = `${Math.round(spec.acceptance * 100)}% accepted ` +
    `(${spec.accepted_tokens} of ${spec.drafted_tokens} drafted tokens${sources ? `: ${sources}` : ""})` +
    (spec.mtp && spec.mtp.loaded ? "; the model's MTP head drafts" : "");
}

// One reading of the head's generated-token counter becomes a rate since the last one.
function record(tokens) {
  const t = performance.now();
  if (previous && tokens >= previous.tokens && t > previous.t) {   // a restarted head counts from 0 again
    rates.push({ t, rate: (tokens - previous.tokens) / ((t - previous.t) / 1000) });
  }
  previous = { t, tokens };
  while (rates.length && rates[0].t < t - WINDOW_S * 1000) rates.shift();
}

const SVG = "http://www.w3.org/2000/svg";

function drawChart() {
  const svg = $("rate-chart");
  const w = 300, h = 60, now = performance.now();
  const span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, rates.length ? (now - rates[0].t) / 1000 : 0)) * 1000;
  const top = Math.max(1, ...rates.map((r) => r.rate));
  const x = (t) => (w * (t - (now - span))) / span;
  const y = (rate) => h - 2 - ((h - 4) * rate) / top;
  const points = rates.map((r) => `${x(r.t).toFixed(1)},${y(r.rate).toFixed(1)}`);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.join(" "));
  line.setAttribute("class", "line");
  const area = document.createElementNS(SVG, "polygon");
  if (rates.length) area.setAttribute("points", `${x(rates[0].t).toFixed(1)},${h} ${points.join(" ")} ${x(rates.at(-1).t).toFixed(1)},${h}`);
  area.setAttribute("class", "area");
  svg.replaceChildren(area, line);
  const current = rates.at(-1)?.rate ?? 0;
  $("rate-now").textContent = `${current.toFixed(1)} tok/s now`;
  $("rate-top").textContent = `peak ${top.toFixed(1)}`;
  $("rate-span").textContent = span >= 120_000 ? `${Math.round(span / 60_000)} min ago` : `${Math.round(span / 1000)} s ago`;
}

function renderHealth(h) {
  // The served context: tokens one request may hold, prompt and reply.
  $("model").textContent = h.context_length ? `${h.model} · ${h.context_length.toLocaleString("en")}-token context` : h.model;
  setStatus(h.status, h.status === "ok" ? "ready" : "unavailable");
  $("live-requests").textContent = `· ${h.live_requests} live request${h.live_requests === 1 ? "" : "s"}`;
  $("reason").hidden = !h.reason;
  $("reason").textContent = h.reason || "";

  if (cards.size !== h.stages.length) {
    cards.clear();
    $("stages").replaceChildren();
  }
  for (const s of h.stages) {
    if (!cards.has(s.stage)) {
      cards.set(s.stage, stageCard());
      $("stages").append(cards.get(s.stage).el);
    }
    renderStage(cards.get(s.stage), s);
  }
  renderSpeculation(h.speculation);
  renderLinks(h.links || [], h.link_warnings || []);
  if (typeof h.generated_tokens === "number") record(h.generated_tokens);
  drawChart();
}

// Each link's latency and throughput; a warned one (far slower, or Wi-Fi-like) marked.
function renderLinks(links, warnings) {
  const items = links.map((l) => {
    const li = document.createElement("li");
    const rate = l.bytes_per_s ? `${(l.bytes_per_s / 1e6).toFixed(1)} MB/s` : "–";
    li.textContent = `${l.name}: ${(l.latency_s * 1e3).toFixed(2)} ms, ${rate}`;
    li.title = `${l.source} -> ${l.target} (${l.basis})`;
    if (warnings.some((w) => w.startsWith(`link ${l.name} `))) li.className = "slow";
    return li;
  });
  $("links").replaceChildren(...items);
}

function setStatus(status, text) {
  $("cluster-status").dataset.status = status;
  $("cluster-status").textContent = text;
}

/** Reads /health every second, for good; `headers()`: the API key's header, if any. */
export async function watchCluster(headers) {
  for (;;) {
    try {
      const response = await fetch("/health", { cache: "no-store", headers: headers() });
      if (response.status === 401) {
        setStatus("offline", "this server needs an API key (settings)");
      } else {
        const health = await response.json();    // 200 and 503 both carry the full body
        if (!Array.isArray(health.stages)) throw new Error(`unexpected /health reply ${response.status}`);
        renderHealth(health);
        $("cluster").classList.remove("stale");
      }
    } catch {
      setStatus("offline", "head unreachable");
      $("cluster").classList.add("stale");        // the last figures, greyed out
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}
