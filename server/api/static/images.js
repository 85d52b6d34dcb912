// Images a user attaches to a message, for a model that reads them (/v1/models says so:
// `input_modalities` holds "image"). Each is read in this browser into a data URL and
// sent as an OpenAI `image_url` part; nothing is uploaded anywhere else.

const $ = (id) => document.getElementById(id);

const pending = [];   // data URLs of the images the next message carries

/** Whether the served model takes images, from /v1/models. */
export async function takesImages(headers) {
  try {
    const r = await fetch("/v1/models", { headers });
    const card = (await r.json()).data?.[0];
    return Boolean(card?.input_modalities?.includes("image"));
  } catch {
    return false;
  }
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

/** An <img> of a data URL the user gave (never a URL from a reply: render.js links those). */
export function thumb(url) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.alt = "attached image";
  img.src = url;
  return img;
}

function showPending() {
  const box = $("attached");
  box.hidden = !pending.length;
  box.replaceChildren(...pending.map((url, i) => {
    const fig = document.createElement("figure");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove secondary";
    remove.textContent = "×";
    remove.title = "Remove this image";
    remove.addEventListener("click", () => { pending.splice(i, 1); showPending(); });
    fig.append(thumb(url), remove);
    return fig;
  }));
}

/** Show the attach button and take the files the user picks. */
export function enableAttach() {
  $("attach").hidden = false;
  $("takes-images").hidden = false;
  $("attach").addEventListener("click", () => $("attach-files").click());
  $("attach-files").addEventListener("change", async (e) => {
    for (const file of e.target.files) pending.push(await readAsDataUrl(file));
    e.target.value = "";
    showPending();
  });
}

/** The next message's content: its text, or, with images, OpenAI's parts; the images are taken. */
export function takeContent(text) {
  if (!pending.length) return text;
  const parts = pending.splice(0).map((url) => ({ type: "image_url", image_url: { url } }));
  showPending();
  return text ? [...parts, { type: "text", text }] : parts;
}

export function hasPending() {
  return pending.length > 0;
}

/** A user turn's text and images, from its content (a string, or parts). */
export function contentParts(content) {
  if (typeof content === "string") return { text: content, images: [] };
  return {
    text: content.filter((p) => p.type === "text").map((p) => p.text).join("\n"),
    images: content.filter((p) => p.type === "image_url").map((p) => p.image_url.url),
  };
}
