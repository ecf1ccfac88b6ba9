// mlxspec's chat page: streams chats from this server's own /v1/chat/completions. Plain
// JavaScript, nothing loaded from anywhere else. Model text is only ever set as text
// (textContent, text nodes), never parsed as HTML.
"use strict";

const KEY_STORE = "mlxspec-api-key";
const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, info: null };

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text) {
  $("status").textContent = text;
}

async function loadInfo() {
  try {
    const response = await fetch("/ui/info");
    const info = await response.json();
    state.info = info;
    $("model").textContent = info.model;
    let drafter = info.drafter + (info.draft_model ? " (" + info.draft_model + ")" : "");
    if (info.depth) drafter += ", depth " + info.depth;
    $("drafter").textContent = drafter;
    if (info.needs_key) {
      $("keybar").hidden = false;
      $("key").value = apiKey();
      if (!apiKey()) $("keynote").textContent = "enter it before sending";
    }
  } catch (err) {
    setStatus("cannot reach the server: " + err);
  }
}

function addMessage(role, text) {
  const box = el("div", "message " + role);
  box.append(el("div", "role", role === "user" ? "you" : (state.info ? state.info.model : "model")));
  const thinking = el("details", "thinking");
  thinking.hidden = true;
  thinking.append(el("summary", "", "Thinking"));
  const reasoning = el("div", "reasoning");
  thinking.append(reasoning);
  const content = el("div", "content", text || "");
  box.append(thinking, content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, thinking, reasoning, content };
}

function note(message, text, isError) {
  const line = el("div", "note" + (isError ? " error" : ""), text);
  message.box.append(line);
}

// TEXT appended to CONTAINER with SPANS ([[start, end], ...], relative to TEXT) marked as drafted
function appendMarked(container, text, spans) {
  let at = 0;
  for (const span of Array.isArray(spans) ? spans : []) {
    const start = Math.max(at, Math.min(text.length, span[0] | 0));
    const end = Math.max(start, Math.min(text.length, span[1] | 0));
    if (start > at) container.append(document.createTextNode(text.slice(at, start)));
    if (end > start) container.append(el("span", "drafted", text.slice(start, end)));
    at = end;
  }
  if (at < text.length) container.append(document.createTextNode(text.slice(at)));
}

function formatStatus(run, final) {
  const seconds = run.firstAt ? (performance.now() - run.firstAt) / 1000 : 0;
  const parts = [run.tokens + " tokens"];
  if (seconds > 0 && run.tokens > 1) parts.push(((run.tokens - 1) / seconds).toFixed(1) + " tok/s");
  if (run.drafts > 0) {
    parts.push("acceptance " + (100 * run.accepted / run.drafts).toFixed(0) + "% (" + run.accepted + "/" +
               run.drafts + " drafted)");
  } else {
    parts.push("nothing drafted");
  }
  if (final) parts.push(final);
  return parts.join(" · ");
}

function onChunk(chunk, run, message) {
  if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
  const ext = chunk.x_mlxspec;
  if (ext) {
    run.tokens = ext.completion_tokens;
    run.drafts = ext.draft_tokens;
    run.accepted = ext.accepted_tokens;
  }
  if (chunk.usage) {
    run.tokens = chunk.usage.completion_tokens;
    const spec = chunk.usage.speculation || {};
    run.drafts = spec.drafted || 0;
    run.accepted = spec.accepted || 0;
    if (spec.drafter && state.info && state.info.drafter !== spec.drafter) {
      $("drafter").textContent = state.info.drafter + " (last reply: " + spec.drafter + ")";
    }
  }
  const choice = (chunk.choices || [])[0];
  if (!choice) return;
  const delta = choice.delta || {};
  const spans = ext ? ext.drafted : [];
  if (delta.reasoning_content) {
    if (!run.firstAt) run.firstAt = performance.now();
    message.thinking.hidden = false;
    appendMarked(message.reasoning, delta.reasoning_content, spans);
  }
  if (delta.content) {
    if (!run.firstAt) run.firstAt = performance.now();
    appendMarked(message.content, delta.content, spans);
    run.text += delta.content;
  }
  if (choice.finish_reason) run.finish = choice.finish_reason;
}

async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (err) {
    return response.statusText;
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("prompt").disabled = busy;
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const message = addMessage("assistant");
  const run = { tokens: 0, drafts: 0, accepted: 0, firstAt: 0, text: "", finish: null };
  const headers = { "Content-Type": "application/json" };
  if (apiKey()) headers.Authorization = "Bearer " + apiKey();
  const body = { messages: state.history, stream: true,
                 stream_options: { include_usage: true, include_speculation: true } };
  if (state.info && state.info.model) body.model = state.info.model;
  const temperature = $("temperature").value, maxTokens = $("max-tokens").value;
  if (temperature !== "") body.temperature = Number(temperature);
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  state.controller = new AbortController();
  setBusy(true);
  setStatus("waiting for the model…");
  const ticker = setInterval(() => { if (run.firstAt) setStatus(formatStatus(run)); }, 250);
  let failed = false;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body),
                                                            signal: state.controller.signal });
    if (response.status === 401) {
      $("keybar").hidden = false;
      $("keynote").textContent = "the server refused the key: enter the right one";
      throw new Error("the server needs a valid API key (enter it above)");
    }
    if (!response.ok) throw new Error(response.status + ": " + (await errorText(response)));
    await readEvents(response, (chunk) => onChunk(chunk, run, message));
    setStatus(formatStatus(run, "finished: " + (run.finish || "stop")));
  } catch (err) {
    if (err.name === "AbortError") {
      note(message, "stopped");
      setStatus(formatStatus(run, "stopped"));
    } else {
      failed = true;
      state.history.pop();  // the turn did not happen: the prompt may be sent again
      message.box.classList.add("error");
      note(message, String(err.message || err), true);
      setStatus("error");
    }
  } finally {
    clearInterval(ticker);
    state.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
  if (!failed) state.history.push({ role: "assistant", content: run.text });
}

function submit(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
}

function init() {
  $("composer").addEventListener("submit", submit);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) submit(event);
  });
  $("stop").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
  });
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("messages").replaceChildren();
    setStatus("ready");
  });
  $("keybar").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key").value.trim());
    $("keynote").textContent = $("key").value.trim() ? "" : "enter it before sending";
  });
  loadInfo();
  $("prompt").focus();
}

init();
