// Markdown to safe DOM: marked parses, highlight.js colours code, DOMPurify removes
// anything that could run (scripts, event handlers, javascript: links) before it is shown.

import { Marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.js";
import hljs from "./vendor/highlight/core.min.js";
import bash from "./vendor/highlight/languages/bash.min.js";
import c from "./vendor/highlight/languages/c.min.js";
import cpp from "./vendor/highlight/languages/cpp.min.js";
import css from "./vendor/highlight/languages/css.min.js";
import diff from "./vendor/highlight/languages/diff.min.js";
import go from "./vendor/highlight/languages/go.min.js";
import java from "./vendor/highlight/languages/java.min.js";
import javascript from "./vendor/highlight/languages/javascript.min.js";
import json from "./vendor/highlight/languages/json.min.js";
import markdown from "./vendor/highlight/languages/markdown.min.js";
import plaintext from "./vendor/highlight/languages/plaintext.min.js";
import python from "./vendor/highlight/languages/python.min.js";
import rust from "./vendor/highlight/languages/rust.min.js";
import shell from "./vendor/highlight/languages/shell.min.js";
import sql from "./vendor/highlight/languages/sql.min.js";
import typescript from "./vendor/highlight/languages/typescript.min.js";
import xml from "./vendor/highlight/languages/xml.min.js";
import yaml from "./vendor/highlight/languages/yaml.min.js";

for (const [name, grammar] of Object.entries({ bash, c, cpp, css, diff, go, java, javascript, json, markdown,
                                               plaintext, python, rust, shell, sql, typescript, xml, yaml })) {
  hljs.registerLanguage(name, grammar);
}

const escapeHtml = (s) => s.replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);

const md = new Marked({
  gfm: true,
  breaks: true,   // a model's single newlines are line breaks (poems, addresses)
  renderer: {
    code({ text, lang }) {
      const language = (lang || "").match(/^\S*/)[0].toLowerCase();
      const known = language && hljs.getLanguage(language) ? language : "";
      const body = known ? hljs.highlight(text, { language: known, ignoreIllegals: true }).value : escapeHtml(text);
      return `<pre data-lang="${escapeHtml(language)}"><code class="hljs${known ? ` language-${known}` : ""}">${body}</code></pre>\n`;
    },
    // No image is fetched (a reply could otherwise send the conversation to any server
    // in an image URL): it becomes a link the reader may follow.
    image({ href, text }) {
      return `<a href="${escapeHtml(href || "")}">[image: ${escapeHtml(text || href || "")}]</a>`;
    },
  },
});

const purify = DOMPurify(window);
purify.addHook("uponSanitizeElement", (node, data) => {
  // GFM task lists are the only inputs kept, and they cannot be changed.
  if (data.tagName === "input" && node.getAttribute("type") !== "checkbox") node.remove();
});
purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
  if (node.tagName === "INPUT") node.setAttribute("disabled", "");
});
const PURIFY = {
  RETURN_DOM_FRAGMENT: true,
  FORBID_TAGS: ["img", "picture", "video", "audio", "source", "style", "form", "button", "textarea", "select"],
  FORBID_ATTR: ["style"],
};

/** The code blocks of `root` get a bar with their language and a Copy button. */
function decorateCode(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const box = document.createElement("div");
    box.className = "code";
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const lang = document.createElement("span");
    lang.textContent = pre.dataset.lang || "text";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    bar.append(lang, copy);
    pre.replaceWith(box);
    box.append(bar, pre);
  }
}

/** Safe DOM for marked's HTML `html` (a fragment to insert). */
function safeFragment(html) {
  const fragment = purify.sanitize(html, PURIFY);
  decorateCode(fragment);
  return fragment;
}

/**
 * Shows a markdown text that grows as it streams. Each top-level block (paragraph,
 * list, table, code block) is its own element: blocks whose source did not change are
 * kept as they are, and only the changed tail is rendered again, at most once per frame.
 */
export class MarkdownView {
  constructor(el) {
    this.el = el;
    this.text = "";
    this.shown = null;         // the text the blocks show
    this.blocks = [];          // [{raw, node}] in order
    this.frame = 0;
  }

  /** Show `text` at the next animation frame (several calls in one frame render once);
   *  `now`: at once (a stored reply, the end of a stream). */
  set(text, now = false) {
    this.text = text;
    if (now) this.flush();
    else if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  /** Render now (the stream ended, or the page is hidden and frames do not come). */
  flush() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    if (this.text === this.shown) return;
    this.shown = this.text;
    const tokens = md.lexer(this.text).filter((t) => t.type !== "space");
    let keep = 0;       // the last block may still grow: it is always rendered again
    while (keep < this.blocks.length && keep < tokens.length - 1 && this.blocks[keep].raw === tokens[keep].raw) keep++;
    for (const block of this.blocks.splice(keep)) block.node.remove();
    for (const token of tokens.slice(keep)) {
      const node = document.createElement("div");
      node.className = "md-block";
      node.append(safeFragment(md.parser([token])));
      this.el.append(node);
      this.blocks.push({ raw: token.raw, node });
    }
  }
}

/** Copies the code of the block whose Copy button is `button`. */
export async function copyCode(button) {
  const text = button.closest(".code").querySelector("pre").textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {                // no clipboard API outside secure contexts (http on a LAN address)
    const area = document.createElement("textarea");
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}
