// A reply: streamed from /v1/chat/completions (server-sent events) into a turn, and
// shown in its bubble as reasoning (collapsed), tool calls, markdown, markers and figures.

import { MarkdownView } from "./render.js";

/** A fresh assistant turn, filled in as the reply streams. */
export function assistantTurn() {
  return { role: "assistant", content: "", reasoning: "", tool_calls: [], finish: null, note: null, stats: {} };
}

/** The messages the API gets for `turns` (what the model said, not its reasoning). */
export function apiMessages(turns) {
  return turns.map((t) => {
    if (t.role !== "assistant") return { role: t.role, content: t.content };
    const m = { role: "assistant", content: t.content };
    if (t.tool_calls?.length) m.tool_calls = t.tool_calls.map(({ id, type, function: f }) => ({ id, type, function: f }));
    return m;
  });
}

/** Yields the JSON objects of a server-sent event stream, until `data: [DONE]`. */
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
    return body.error?.message || body.detail || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Tool calls arrive whole or in pieces (OpenAI's form: the same index, more arguments).
function mergeToolCalls(calls, deltas) {
  for (const d of deltas) {
    const i = d.index ?? calls.length;
    const call = calls[i] ??= { id: d.id, type: d.type || "function", function: { name: "", arguments: "" } };
    call.id ||= d.id;
    call.function.name += d.function?.name || "";
    call.function.arguments += d.function?.arguments || "";
  }
}

/**
 * Streams the completion of `body` into `turn`, calling `changed()` after each event.
 * Throws on an HTTP error or an error event; an AbortError when `signal` aborts.
 * `turn.stats`: time to first token as it comes; tokens, cached tokens and tok/s from
 * the closing `usage` (asked for with `stream_options.include_usage`).
 */
export async function streamReply(body, headers, signal, turn, changed) {
  const started = performance.now();
  let first = null, last = null;
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...headers },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const event of events(response)) {
    if (event.error) throw new Error(event.error.message);
    const now = performance.now();
    const choice = event.choices?.[0];
    const d = choice?.delta || {};
    if (d.content || d.reasoning_content || d.tool_calls?.length) {
      turn.content += d.content || "";
      turn.reasoning += d.reasoning_content || "";
      if (d.tool_calls?.length) mergeToolCalls(turn.tool_calls, d.tool_calls);
      if (first === null) {
        first = now;
        turn.stats.ttft_s = (now - started) / 1000;
      }
      last = now;
    }
    if (choice?.finish_reason) turn.finish = choice.finish_reason;
    if (event.usage) {
      const n = event.usage.completion_tokens;
      Object.assign(turn.stats, {
        prompt_tokens: event.usage.prompt_tokens,
        completion_tokens: n,
        cached_tokens: event.usage.prompt_tokens_details?.cached_tokens ?? 0,
        // After the first token; not when the reply came in one burst (a buffering proxy).
        tok_s: n > 1 && last - first > 50 ? (n - 1) / ((last - first) / 1000) : null,
      });
    }
    changed();
  }
}

const FINISH_NOTES = {
  length: "stopped at max_tokens: raise max_tokens for a longer reply",
  content_filter: "stopped by a filter",
};

/** An assistant bubble: reasoning, tool calls, answer, markers, figures; drawn once a frame
 *  (then `drawn()` is called). */
export class ReplyView {
  constructor(el, drawn = () => {}) {
    this.el = el;
    this.drawn = drawn;
    el.innerHTML = `
      <details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-text"></div></details>
      <div class="tool-calls" hidden></div>
      <div class="answer"></div>
      <div class="notes"></div>
      <div class="stats"></div>`;
    this.parts = Object.fromEntries(["reasoning", "reasoning-text", "tool-calls", "notes", "stats"]
      .map((cls) => [cls, el.querySelector(`.${cls}`)]));
    this.answer = new MarkdownView(el.querySelector(".answer"));
    this.turn = null;
    this.frame = 0;
  }

  /** Draw `turn` at the next animation frame; `now`: at once. */
  show(turn, now = false) {
    this.turn = turn;
    if (now) this.flush();
    else if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  flush() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    const t = this.turn, p = this.parts;
    p.reasoning.hidden = !t.reasoning;
    if (p["reasoning-text"].textContent !== t.reasoning) p["reasoning-text"].textContent = t.reasoning;
    p["tool-calls"].hidden = !t.tool_calls.length;
    p["tool-calls"].replaceChildren(...t.tool_calls.map(toolCallCard));
    this.answer.set(t.content, true);
    p.notes.replaceChildren(...notes(t));
    p.stats.textContent = statsLine(t.stats);
    this.el.classList.toggle("pending", !t.content && !t.reasoning && !t.tool_calls.length);
    this.drawn();
  }
}

function toolCallCard(call) {
  const card = document.createElement("div");
  card.className = "tool-call";
  const name = document.createElement("div");
  name.className = "tool-name";
  name.textContent = `tool call: ${call.function.name || "?"}`;
  const args = document.createElement("pre");
  args.className = "tool-args";
  try {
    args.textContent = JSON.stringify(JSON.parse(call.function.arguments), null, 2);
  } catch {                       // still arriving, or not JSON: as the model wrote it
    args.textContent = call.function.arguments;
  }
  card.append(name, args);
  return card;
}

function notes(t) {
  const out = [];
  for (const [cls, text] of [[t.finish, FINISH_NOTES[t.finish]], ["stopped", t.note === "stopped" && "stopped"]]) {
    if (!text) continue;
    const el = document.createElement("span");
    el.className = `note ${cls}`;
    el.textContent = text;
    out.push(el);
  }
  return out;
}

function statsLine(s) {
  const parts = [];
  if (s.completion_tokens !== undefined) parts.push(`${s.completion_tokens} tokens`);
  if (s.tok_s) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  if (s.ttft_s !== undefined) parts.push(`first token ${s.ttft_s.toFixed(2)} s`);
  if (s.cached_tokens !== undefined) parts.push(`${s.cached_tokens} of ${s.prompt_tokens} prompt tokens cached`);
  return parts.join(" · ");
}
