// The conversation and the settings, kept in this browser's localStorage across reloads.

const CHAT_KEY = "mlxpipe.chat.v1";

/**
 * The stored turns: {role: "user", content} and {role: "assistant", content, reasoning,
 * tool_calls, finish, stats}; [] when there are none or they cannot be read.
 */
export function loadTurns() {
  try {
    const stored = JSON.parse(localStorage.getItem(CHAT_KEY) || "null");
    return Array.isArray(stored?.turns) ? stored.turns : [];
  } catch {
    return [];
  }
}

export function saveTurns(turns) {
  try {
    localStorage.setItem(CHAT_KEY, JSON.stringify({ turns }));
  } catch (err) {          // full or disabled storage: the chat goes on, unsaved
    console.warn("the conversation could not be saved:", err);
  }
}

export function forgetTurns() {
  localStorage.removeItem(CHAT_KEY);
}

/** Inputs whose values are kept (by id); the API key too, as before, in this browser only. */
const KEPT = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_strings", "api_key"];

export function restoreSettings() {
  for (const id of KEPT) {
    const value = localStorage.getItem(`mlxpipe.${id}`);
    if (value !== null) document.getElementById(id).value = value;
  }
}

export function keepSettings() {
  for (const id of KEPT) localStorage.setItem(`mlxpipe.${id}`, document.getElementById(id).value);
}
