// mlxpipe's page: a streaming chat over /v1/chat/completions, kept in this browser,
// and a live view of /health. The parts: render.js (markdown), chat.js (a reply),
// cluster.js (the cluster view), storage.js (localStorage).

import { apiMessages, assistantTurn, ReplyView, streamReply } from "./chat.js";
import { watchCluster } from "./cluster.js";
import { contentParts, enableAttach, hasPending, takeContent, takesImages, thumb } from "./images.js";
import { copyCode } from "./render.js";
import { forgetTurns, keepSettings, loadTurns, restoreSettings, saveTurns } from "./storage.js";

const $ = (id) => document.getElementById(id);

const turns = loadTurns();   // the conversation, sent whole with every request
let controller = null;       // the AbortController of the reply being streamed

function bubble(role) {
  const list = $("messages");
  list.querySelector(".empty")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  list.append(el);
  return el;
}

function userBubble(content) {
  const el = bubble("user");
  const { text, images } = contentParts(content);
  el.textContent = text;
  if (images.length) {
    const row = document.createElement("div");
    row.className = "thumbs";
    row.append(...images.map(thumb));
    el.append(row);
  }
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
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The request body: the conversation, and only the settings that are filled in.
function requestBody() {
  const system = $("system").value.trim();
  const messages = apiMessages(turns);
  const body = { model: "default", messages: system ? [{ role: "system", content: system }, ...messages] : messages };
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

function setStreaming(on) {
  $("send").disabled = on;
  $("new-chat").disabled = on;
  $("stop").disabled = !on;
  document.body.classList.toggle("streaming", on);
}

async function send() {
  const text = $("prompt").value.trim();
  if ((!text && !hasPending()) || controller) return;
  $("prompt").value = "";
  keepSettings();
  const content = takeContent(text);   // with images: OpenAI's parts
  const userEl = userBubble(content);
  turns.push({ role: "user", content });
  const body = requestBody();
  const turn = assistantTurn();
  const view = new ReplyView(bubble("assistant"), () => scrollDown());
  view.show(turn, true);
  scrollDown(true);
  let failure = null;

  controller = new AbortController();
  setStreaming(true);
  try {
    await streamReply(body, authHeaders(), controller.signal, turn, () => view.show(turn));
  } catch (err) {
    if (err.name === "AbortError") turn.note = "stopped";
    else failure = err.message;
  } finally {
    controller = null;
    setStreaming(false);
  }

  if (turn.content || turn.reasoning || turn.tool_calls.length) {
    turns.push(turn);
    view.show(turn, true);
  } else {                               // a turn without a reply is not kept
    view.el.remove();
    turns.pop();
    userEl.classList.add("unsent");
  }
  saveTurns(turns);
  if (failure) bubble("error").textContent = failure;
  scrollDown();
  $("prompt").focus();
}

function showConversation() {
  $("messages").replaceChildren();
  if (!turns.length) {
    $("messages").innerHTML = '<p class="empty">Send a message to start. The reply streams in token by token.</p>';
    return;
  }
  for (const t of turns) {
    if (t.role === "user") userBubble(t.content);
    else new ReplyView(bubble("assistant")).show({ ...assistantTurn(), ...t }, true);
  }
  scrollDown(true);
}

function newChat() {
  turns.length = 0;
  forgetTurns();
  showConversation();
  $("prompt").focus();
}

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", newChat);
$("messages").addEventListener("click", (e) => {
  const button = e.target.closest("button.copy");
  if (button) copyCode(button);
});
$("settings").addEventListener("change", keepSettings);

restoreSettings();
showConversation();
watchCluster(authHeaders);
takesImages(authHeaders()).then((yes) => { if (yes) enableAttach(); });
