// mlx-stream's chat page: chats through POST /v1/chat/completions (streamed), shows the
// server's memory from /health and /v1/sessions. No build step, no network but this server.
// Every piece of text (model output above all) goes into the page as text nodes: nothing
// is ever parsed as HTML.
"use strict";

const PREFIX = "mlx-stream.";
const CONV = PREFIX + "conv."; // one localStorage key per conversation: tabs never clobber each other
const SETTINGS = PREFIX + "settings";
const KEY = PREFIX + "api-key";
const POLL_BUSY_MS = 1000; // /v1/sessions while a reply streams
const POLL_IDLE_MS = 5000; // and otherwise (each poll is a line in serve's access log)
const MAX_POINTS = 400; // plot points kept per conversation

const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------- DOM helpers

function el(tag, cls, ...children) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  for (const child of children) {
    if (child == null) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text != null) node.textContent = text;
  return node;
}

function button(label, cls, onclick, title) {
  const b = el("button", cls, label);
  b.type = "button";
  if (title) b.title = title;
  b.addEventListener("click", onclick);
  return b;
}

// ----------------------------------------------------- markdown, rendered safely
// Hand-written rather than a library: the page loads nothing from a CDN and has no build
// step, and a renderer that only ever makes elements and text nodes cannot run model output.

function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      i++; // the closing fence (or the end: a block still streaming)
      const pre = el("pre", null, el("code", null, code.join("\n")));
      if (fence[1]) pre.prepend(el("span", "lang", fence[1]));
      out.append(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      out.append(inline(el(heading[1].length <= 2 ? "h3" : "h4"), heading[2]));
      i++;
      continue;
    }
    if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
        list.append(inline(el("li"), lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, "")));
        i++;
      }
      out.append(list);
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quote = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quote.push(lines[i++].replace(/^\s*>\s?/, ""));
      out.append(inline(el("blockquote"), quote.join("\n")));
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !/^\s*(```|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(lines[i])) {
      para.push(lines[i++]);
    }
    if (!para.length) para.push(lines[i++]);
    out.append(inline(el("p"), para.join("\n")));
  }
  return out;
}

// `code`, **bold**, *italic*, [text](http(s) link): anything else stays literal text.
const INLINE = /`([^`]+)`|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    if (m[1] != null) parent.append(el("code", null, m[1]));
    else if (m[2] != null) parent.append(el("strong", null, m[2]));
    else if (m[3] != null) parent.append(el("em", null, m[3]));
    else {
      const a = el("a", null, m[4]);
      a.href = m[5]; // only http(s): the pattern never matches javascript: or data:
      a.target = "_blank";
      a.rel = "noopener noreferrer";
      parent.append(a);
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
  return parent;
}

// ------------------------------------------------------------------------ storage

function load(key, fallback) {
  try {
    const v = localStorage.getItem(key);
    return v == null ? fallback : JSON.parse(v);
  } catch {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    showNotice(`Could not save in this browser's storage (${e.name}): older conversations may need deleting.`);
  }
}

function conversations() {
  const list = [];
  for (let i = 0; i < localStorage.length; i++) {
    const k = localStorage.key(i);
    if (k && k.startsWith(CONV)) {
      const c = load(k, null);
      if (c && Array.isArray(c.messages)) list.push(c);
    }
  }
  return list.sort((a, b) => b.updated - a.updated);
}

function randomId() {
  const bytes = new Uint8Array(8);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function newConversation() {
  const id = randomId();
  return { id, session: "ui-" + id, title: "New chat", system: "", messages: [], points: [], updated: Date.now() };
}

function store(conv) {
  conv.updated = Date.now();
  save(CONV + conv.id, conv);
}

// -------------------------------------------------------------------------- state

const state = {
  conv: null,
  settings: load(SETTINGS, { model: "", temperature: "", top_p: "", max_tokens: "", seed: "" }),
  streaming: null, // {controller, message}
  online: null, // null before the first answer, then true/false
  health: null,
  sessions: null,
  live: null, // the streaming reply's tokens and times
  pollTimer: null,
};

function openConversation(conv) {
  state.conv = conv;
  sessionStorage.setItem(PREFIX + "current", conv.id); // per tab: a reload keeps it
  renderAll();
}

// ---------------------------------------------------------------------- HTTP calls

class HttpError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function failure(res) {
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    /* not JSON: the status line says it */
  }
  if (res.status === 401) askKey(localStorage.getItem(KEY) ? "The server refused this API key." : null);
  const retry = res.headers.get("Retry-After");
  return new HttpError(res.status, message, retry == null ? null : Number(retry));
}

async function getJson(path) {
  const res = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!res.ok) throw await failure(res);
  return res.json();
}

// ------------------------------------------------------------------ connection

function setOnline(online, why) {
  const was = state.online;
  state.online = online;
  const pill = $("status");
  if (online) {
    pill.className = "pill ok";
    pill.textContent = "online";
    pill.title = state.health ? `serving ${state.health.model}` : "";
    if (was === false) {
      showNotice("Reconnected to the server (it restarted or the network came back).", 8000);
      loadModels();
    }
  } else {
    pill.className = "pill bad";
    pill.textContent = "offline";
    if (was !== false) showNotice(`Lost the server (${why}): reconnecting…`);
  }
}

let noticeTimer = null;
function showNotice(text, hideAfterMs) {
  const n = $("notice");
  n.textContent = text;
  n.hidden = false;
  clearTimeout(noticeTimer);
  if (hideAfterMs) noticeTimer = setTimeout(() => (n.hidden = true), hideAfterMs);
}

async function poll() {
  clearTimeout(state.pollTimer);
  try {
    state.health = await getJson("/health");
    state.sessions = await getJson("/v1/sessions");
    setOnline(true);
    notePoint();
  } catch (e) {
    if (e instanceof HttpError) setOnline(true); // it answered: the key dialog says the rest
    else setOnline(false, e.message || "no answer");
  }
  renderPanel();
  const wait = state.streaming ? POLL_BUSY_MS : state.online === false ? 2000 : POLL_IDLE_MS;
  if (!document.hidden || state.streaming) state.pollTimer = setTimeout(poll, wait);
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden) poll();
});

async function loadModels() {
  try {
    const listed = (await getJson("/v1/models")).data;
    const models = listed.map((m) => m.id);
    const select = $("model");
    // several models: one not loaded yet loads on its first request (a wait)
    const option = (m) => {
      const node = el("option", null, m.loaded === false ? `${m.id} (loads when used)` : m.id);
      node.value = m.id;
      return node;
    };
    select.replaceChildren(...listed.map(option));
    if (models.includes(state.settings.model)) select.value = state.settings.model;
    state.settings.model = select.value;
  } catch (e) {
    if (!(e instanceof HttpError)) setOnline(false, e.message);
  }
}

function askKey(why) {
  const dialog = $("key-dialog");
  if (why) $("key-why").textContent = why;
  if (!dialog.open) dialog.showModal();
  $("key").focus();
}

// --------------------------------------------------------------------- chatting

function requestMessages(conv) {
  const msgs = conv.system ? [{ role: "system", content: conv.system }] : [];
  for (const m of conv.messages) {
    if (m.state === "error" || (m.role === "assistant" && !m.content)) continue;
    msgs.push({ role: m.role, content: m.content });
  }
  return msgs;
}

function body(conv) {
  const s = state.settings;
  const b = { model: s.model || "default", messages: requestMessages(conv), stream: true,
    stream_options: { include_usage: true } };
  for (const [name, parse] of [["temperature", Number], ["top_p", Number], ["max_tokens", parseInt], ["seed", parseInt]]) {
    if (s[name] !== "" && s[name] != null && !Number.isNaN(parse(s[name]))) b[name] = parse(s[name]);
  }
  return b;
}

function dropErrors(conv) {
  conv.messages = conv.messages.filter((m) => m.state !== "error");
}

async function send(text) {
  const conv = state.conv;
  dropErrors(conv);
  if (conv.messages.length === 0) conv.title = text.slice(0, 60);
  conv.messages.push({ role: "user", content: text });
  await reply(conv);
}

async function reply(conv) {
  dropErrors(conv);
  const message = { role: "assistant", content: "", state: "streaming" };
  conv.messages.push(message);
  store(conv);
  const controller = new AbortController();
  state.streaming = { controller, message, conv };
  const live = (state.live = { start: performance.now(), first: null, chunks: 0, end: null });
  renderAll();
  poll();
  let finish = null, usage = null, done = false;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { ...headers(), "X-Session-ID": conv.session },
      body: JSON.stringify(body(conv)),
      signal: controller.signal,
    });
    if (!res.ok) throw await failure(res);
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue; // ": ping" keep-alives
          const data = line.slice(5).trim();
          if (data === "[DONE]") {
            done = true;
            continue;
          }
          const chunk = JSON.parse(data);
          if (chunk.error) throw new HttpError(500, chunk.error.message || "the server failed");
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          if (choice.delta && choice.delta.content) {
            if (live.first == null) live.first = performance.now();
            live.chunks++;
            message.content += choice.delta.content;
            scheduleMessageRender();
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    message.state = done ? (finish === "length" ? "length" : undefined) : "cut";
  } catch (e) {
    if (e.name === "AbortError") message.state = "stopped";
    else if (e instanceof HttpError) {
      message.state = "error";
      message.status = e.status;
      message.error = e.message;
      message.retryAt = e.retryAfter != null ? Date.now() + e.retryAfter * 1000 : null;
    } else {
      message.state = message.content ? "cut" : "error";
      message.error = `the connection was lost (${e.message})`;
      setOnline(false, e.message);
    }
  }
  live.end = performance.now();
  if (message.state === "error" && message.content) message.state = "cut";
  if (message.state !== "error") {
    message.stats = turnStats(live, usage);
    if (usage) conv.lastUsage = usage;
  }
  if (message.state === undefined) delete message.state;
  state.streaming = null;
  store(conv);
  renderAll();
  poll();
}

function turnStats(live, usage) {
  const tokens = usage ? usage.completion_tokens : live.chunks;
  const decode = live.first != null ? (live.end - live.first) / 1000 : 0;
  return {
    ttft_s: live.first != null ? (live.first - live.start) / 1000 : null,
    tokens,
    tok_s: decode > 0 && tokens > 1 ? (tokens - 1) / decode : null,
    prompt: usage ? usage.prompt_tokens : null,
    cached: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
    evicted: usage ? usage.evicted_tokens : null,
  };
}

function regenerate() {
  const conv = state.conv;
  dropErrors(conv);
  while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
  if (conv.messages.length) reply(conv);
}

function editMessage(index, text) {
  const conv = state.conv;
  conv.messages = conv.messages.slice(0, index);
  conv.messages.push({ role: "user", content: text });
  reply(conv);
}

// ---------------------------------------------------------------------- rendering

const fmtBytes = (n) => {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i === 0 ? 0 : n < 10 ? 2 : 1)} ${units[i]}`;
};
const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
const fmtSecs = (s) => (s == null ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : s < 120 ? `${s.toFixed(1)} s` : `${Math.round(s / 60)} min`);

function renderAll() {
  renderList();
  renderMessages();
  renderComposer();
  renderPanel();
}

function renderList() {
  const ul = $("conversations");
  const items = conversations().map((c) => {
    const li = el("li", c.id === state.conv.id ? "current" : null);
    const open = button(c.title || "New chat", "open", () => {
      if (state.streaming) return;
      openConversation(load(CONV + c.id, c));
      document.body.classList.remove("show-sidebar");
    }, c.title);
    const del = button("✕", "link", () => {
      if (state.streaming && state.streaming.conv.id === c.id) return;
      localStorage.removeItem(CONV + c.id);
      if (c.id === state.conv.id) openConversation(conversations()[0] || newConversation());
      else renderList();
    }, "Delete this conversation");
    li.append(open, del);
    return li;
  });
  ul.replaceChildren(...items);
}

function renderMessages() {
  const box = $("messages");
  const conv = state.conv;
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  if (!conv.messages.length) {
    box.replaceChildren(el("div", "empty", "Ask anything. Replies stream from ", el("strong", null, $("model").value || "the server"),
      "; the panel shows its memory, which stays flat however long the conversation."));
    return;
  }
  const lastAssistant = conv.messages.map((m) => m.role).lastIndexOf("assistant");
  box.replaceChildren(...conv.messages.map((m, i) => messageNode(m, i, i === lastAssistant)));
  if (atBottom || state.streaming) box.scrollTop = box.scrollHeight;
}

function messageNode(m, index, last) {
  const node = el("div", `msg ${m.role}` + (m.state ? ` ${m.state}` : ""));
  node.dataset.index = index;
  node.append(el("div", "who", m.role === "user" ? "You" : "Assistant"));
  if (m.state === "error") {
    node.append(errorNode(m));
    return node;
  }
  const bodyNode = el("div", "body");
  if (m.role === "user") bodyNode.textContent = m.content;
  else bodyNode.append(renderMarkdown(m.content));
  node.append(bodyNode);
  const marks = { cut: "✂ cut: the connection was lost; what arrived is kept", stopped: "■ stopped",
    length: "… reached max tokens" };
  if (marks[m.state]) node.append(el("div", "mark", marks[m.state]));
  if (m.state === "streaming") return node;
  const tools = el("div", "tools");
  if (!state.streaming) {
    if (m.role === "user") tools.append(button("Edit", "link edit-btn", () => startEdit(node, index)));
    if (m.role === "assistant" && last) tools.append(button("Regenerate", "link regen-btn", regenerate));
    tools.append(button("Copy", "link", () => navigator.clipboard && navigator.clipboard.writeText(m.content)));
  }
  if (m.stats && m.stats.tokens != null) {
    tools.append(el("span", "meta", `${fmtInt(m.stats.tokens)} tokens` +
      (m.stats.tok_s ? ` · ${m.stats.tok_s.toFixed(1)} tok/s` : "") +
      (m.stats.ttft_s != null ? ` · first token ${fmtSecs(m.stats.ttft_s)}` : "")));
  }
  node.append(tools);
  return node;
}

function errorNode(m) {
  const box = el("div", "body");
  const text = el("div", "mark error");
  box.append(text);
  const retry = button("Retry", "retry-btn", () => regenerate());
  box.append(retry);
  let shown = false;
  const tick = () => {
    if (box.isConnected) shown = true;
    else if (shown) return; // re-rendered: the new node ticks
    const left = m.retryAt ? Math.ceil((m.retryAt - Date.now()) / 1000) : 0;
    if (m.status === 429) {
      text.textContent = `The server is busy (429): ${m.error}. ` +
        (left > 0 ? `Retry in ${left} s (Retry-After).` : "You can retry now.");
    } else {
      text.textContent = m.status ? `Error ${m.status}: ${m.error}` : `Error: ${m.error}`;
    }
    retry.disabled = left > 0;
    if (left > 0) setTimeout(tick, 250);
  };
  tick();
  return box;
}

function startEdit(node, index) {
  const m = state.conv.messages[index];
  const area = el("textarea");
  area.value = m.content;
  const form = el("div", "edit", area, el("div", "row",
    button("Cancel", null, () => renderMessages()),
    button("Save & send", "primary save-edit", () => area.value.trim() && editMessage(index, area.value.trim()))));
  node.querySelector(".body").replaceWith(form);
  const tools = node.querySelector(".tools");
  if (tools) tools.remove();
  area.focus();
}

let renderPending = false;
function scheduleMessageRender() {
  if (renderPending) return;
  renderPending = true;
  requestAnimationFrame(() => {
    renderPending = false;
    const s = state.streaming;
    if (!s || s.conv !== state.conv) return;
    const nodes = $("messages").querySelectorAll(".msg");
    const node = nodes[nodes.length - 1];
    if (!node) return;
    node.querySelector(".body").replaceChildren(renderMarkdown(s.message.content));
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
    renderTurn();
  });
}

function renderComposer() {
  const busy = !!state.streaming;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function dl(id, rows) {
  $(id).replaceChildren(...rows.flatMap(([k, v, cls]) => {
    const dd = el("dd", null, v);
    if (cls) dd.dataset.stat = cls;
    return [el("dt", null, k), dd];
  }));
}

function mySession() {
  const list = state.sessions ? state.sessions.data : [];
  return list.find((s) => s.id === state.conv.session) || null;
}

function notePoint() {
  const s = mySession();
  const conv = state.conv;
  // A session decoding in the server's batch lends its caches to the batch, and its own
  // device_bytes reads 0 until the turn ends: only idle, resident readings are points.
  if (!s || !conv || s.busy || !s.resident || !s.device_bytes) return;
  const last = conv.points[conv.points.length - 1];
  if (last && last[0] === s.tokens_seen) return;
  if (last && s.tokens_seen < last[0]) conv.points = []; // a new session (a restart or an edit)
  conv.points.push([s.tokens_seen, s.device_bytes]);
  if (conv.points.length > MAX_POINTS) conv.points = conv.points.filter((_, i) => i % 2 === 0);
  if (!state.streaming) store(conv);
}

function deviceBytes(s) {
  if (!s) return "–";
  if (!s.resident) return "on disk";
  if (s.busy && !s.device_bytes) { // in the batch: the last reading between turns
    const last = state.conv.points[state.conv.points.length - 1];
    return last ? fmtBytes(last[1]) : "decoding";
  }
  return fmtBytes(s.device_bytes);
}

function renderPanel() {
  const s = mySession();
  const h = state.health;
  const recall = h && h.recall;
  const rows = [
    ["device bytes", deviceBytes(s), "device"],
    ["tokens seen", s ? fmtInt(s.tokens_seen) : "–", "seen"],
    ["tokens evicted", s ? fmtInt(s.tokens_evicted) : "–", "evicted"],
  ];
  if (recall) {
    rows.push(["recall blocks stored", s ? fmtInt(s.blocks_stored) : "–", "recalled"]);
    rows.push(["store RAM / disk", s ? `${fmtBytes(s.store_ram_bytes)} / ${fmtBytes(s.store_disk_bytes)}` : "–", "store"]);
  } else {
    rows.push(["recall store", "off (serve --recall)", "store"]);
  }
  rows.push(["window", s ? `${fmtInt(s.sinks)} sinks + ${fmtInt(s.window)}` : "–"]);
  rows.push(["session", s ? (s.busy ? "busy" : s.resident ? "resident" : "on disk") : "not started", "state"]);
  dl("session-stats", rows);
  renderPlot(s);
  renderTurn();
  if (h) {
    const used = h.used_bytes, budget = h.budget_bytes;
    const fits = h.session_bytes ? Math.floor((budget - h.weights_bytes) / h.session_bytes) : null;
    const bar = el("div", "bar", el("div"));
    bar.firstChild.style.width = `${Math.min(100, (100 * used) / budget).toFixed(1)}%`;
    $("budget").replaceChildren(el("div", "caption", `${fmtBytes(used)} of ${fmtBytes(budget)} budget`), bar,
      el("div", "caption", `weights ${fmtBytes(h.weights_bytes)} · ${fmtBytes(h.session_bytes)} per session` +
        (fits != null ? ` · the budget holds ~${fmtInt(fits)} sessions` : "")));
  }
  const t = state.sessions ? state.sessions.totals : null;
  dl("server-stats", [
    ["MLX active memory", h ? fmtBytes(h.mlx_active_bytes) : "–", "active"],
    ["sessions' device bytes", t ? fmtBytes(t.device_bytes) : "–"],
    ["recall store (all)", t ? fmtBytes(t.store_bytes) : "–"],
    ["evictions / restores", state.sessions ? `${fmtInt(state.sessions.evictions)} / ${fmtInt(state.sessions.restores)}` : "–"],
    ["refusals (429)", state.sessions ? fmtInt(state.sessions.refusals) : "–"],
  ]);
  const list = state.sessions ? state.sessions.data : [];
  $("sessions").replaceChildren(...list.map((x) => {
    const tr = el("tr", x.id === state.conv.session ? "current" : null,
      el("td", "id", x.id.length > 14 ? x.id.slice(0, 13) + "…" : x.id),
      el("td", null, fmtInt(x.tokens_seen)),
      el("td", null, x.resident ? fmtBytes(x.device_bytes) : "disk"),
      el("td", null, x.busy ? "busy" : fmtSecs(x.idle_s)));
    tr.title = x.id;
    return tr;
  }));
  if (!list.length) $("sessions").append(el("tr", null, el("td", null, "none yet")));
}

function renderTurn() {
  const live = state.streaming ? state.live : null;
  let st = null;
  if (live) st = turnStats({ ...live, end: performance.now() }, null);
  else {
    const last = [...state.conv.messages].reverse().find((m) => m.stats);
    st = last ? last.stats : null;
  }
  dl("turn-stats", [
    ["tokens per second", st && st.tok_s ? st.tok_s.toFixed(1) : "–", "tps"],
    ["time to first token", st ? fmtSecs(st.ttft_s) : "–", "ttft"],
    ["tokens generated", st ? fmtInt(st.tokens) : "–", "tokens"],
    ["prompt tokens (cached)", st && st.prompt != null ? `${fmtInt(st.prompt)} (${fmtInt(st.cached)})` : "–", "cached"],
  ]);
}

function renderPlot(s) {
  const plot = $("plot");
  const pts = state.conv.points.slice();
  const W = 320, H = 170, L = 46, R = 10, T = 12, B = 26;
  const nodes = [svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B })];
  if (!pts.length) {
    nodes.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no tokens yet: send a message"));
    plot.replaceChildren(...nodes);
    return;
  }
  const maxX = Math.max(...pts.map((p) => p[0]), 1);
  const maxY = Math.max(...pts.map((p) => p[1]), 1) * 1.25; // from zero: flat reads as flat
  const x = (v) => L + ((W - L - R) * v) / maxX;
  const y = (v) => H - B - ((H - T - B) * v) / maxY;
  if (s && s.sinks + s.window < maxX) { // where the window filled and eviction began
    const wx = x(s.sinks + s.window);
    nodes.push(svg("line", { class: "window", x1: wx, y1: T, x2: wx, y2: H - B }),
      svg("text", { x: wx + 3, y: T + 9 }, "window full"));
  }
  const line = pts.length === 1 ? [[0, pts[0][1]], pts[0]] : pts;
  nodes.push(svg("polyline", { class: "line", points: line.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ") }));
  const lastPt = pts[pts.length - 1];
  nodes.push(svg("circle", { class: "dot", cx: x(lastPt[0]), cy: y(lastPt[1]), r: 3 }));
  nodes.push(svg("text", { x: L - 4, y: y(lastPt[1]) + 3, "text-anchor": "end" }, fmtBytes(lastPt[1])));
  nodes.push(svg("text", { x: L - 4, y: H - B + 3, "text-anchor": "end" }, "0"));
  nodes.push(svg("text", { x: W - R, y: H - 8, "text-anchor": "end" }, `${fmtInt(maxX)} tokens seen`));
  nodes.push(svg("text", { x: L, y: H - 8 }, "0"));
  plot.replaceChildren(...nodes);
}

// -------------------------------------------------------------------------- wiring

function readSettingsForm() {
  for (const name of ["temperature", "top_p", "max_tokens", "seed"]) state.settings[name] = $(name).value;
  save(SETTINGS, state.settings);
  if (state.conv.system !== $("system").value) {
    state.conv.system = $("system").value;
    store(state.conv);
  }
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.streaming) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.streaming && state.streaming.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.streaming) return;
    openConversation(newConversation());
    document.body.classList.remove("show-sidebar");
    $("input").focus();
  });
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    save(SETTINGS, state.settings);
  });
  $("show-settings").addEventListener("click", () => {
    for (const name of ["temperature", "top_p", "max_tokens", "seed"]) $(name).value = state.settings[name] ?? "";
    $("system").value = state.conv.system || "";
    $("settings").showModal();
  });
  $("settings").addEventListener("close", readSettingsForm);
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY);
    showNotice("API key forgotten.", 4000);
  });
  $("key-form").addEventListener("submit", () => {
    const key = $("key").value.trim();
    if (!key) return;
    localStorage.setItem(KEY, key);
    $("key").value = "";
    loadModels();
    poll();
  });
  $("menu").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
  $("show-panel").addEventListener("click", () => document.body.classList.toggle("show-panel"));
  // Other tabs: their conversations show up here; the open one follows their changes.
  window.addEventListener("storage", (e) => {
    if (!e.key || !e.key.startsWith(CONV)) return;
    if (state.conv && e.key === CONV + state.conv.id && !state.streaming && e.newValue) {
      state.conv = JSON.parse(e.newValue);
      renderMessages();
    }
    renderList();
  });
}

function start() {
  wire();
  const current = sessionStorage.getItem(PREFIX + "current");
  const all = conversations();
  state.conv = (current && load(CONV + current, null)) || all[0] || newConversation();
  sessionStorage.setItem(PREFIX + "current", state.conv.id);
  renderAll();
  loadModels().then(renderMessages);
  poll();
  $("input").focus();
}

start();
