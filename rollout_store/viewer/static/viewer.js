// The rollout viewer page. Fetches only the rows and the turn on screen from the JSON
// endpoints next to it (relative URLs, so the page works wherever it is mounted). Every piece of content goes into the DOM through textContent or
// an attribute of a created element, never parsed as markup, so a message holding HTML
// or a script shows as text.
"use strict";

const ROW_HEIGHT = 26;
const PAGE = 100;
const MAX_INDENT = 24;
const AUTO_MEASURE_TURNS = 300;
const LONG_TEXT = 1200;

const pages = new Map(); // page index -> rows (or a pending promise)
let totalRows = 0;
let selectedId = null;
let selectedIndex = 0;
let hasTokens = false; // whether any turn carries token ids (else no token figures)

function plural(n, noun) {
  return n + " " + noun + (n === 1 ? "" : "s");
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

// A text as a URL query or hash value: its UTF-8, percent-encoded, a lone surrogate (an id
// may hold one: the graph keeps every string as it was given) as the three bytes Python's
// "surrogatepass" makes of it, which the server reads back; encodeURIComponent throws on it.
function enc(text) {
  let out = "";
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    const low = i + 1 < text.length ? text.charCodeAt(i + 1) : 0;
    if (c >= 0xd800 && c <= 0xdbff && low >= 0xdc00 && low <= 0xdfff) {
      out += encodeURIComponent(text.slice(i, i + 2));
      i++;
    } else if (c >= 0xd800 && c <= 0xdfff) {
      for (const b of [0xe0 | (c >> 12), 0x80 | ((c >> 6) & 0x3f), 0x80 | (c & 0x3f)]) {
        out += "%" + b.toString(16).toUpperCase();
      }
    } else {
      out += encodeURIComponent(text[i]);
    }
  }
  return out;
}

// What `enc` made of a text (or a hash typed by hand), read back, lone surrogates kept.
function dec(text) {
  const bytes = [];
  const utf8 = new TextEncoder();
  for (let i = 0; i < text.length; i++) {
    if (text[i] === "%" && /^[0-9a-fA-F]{2}$/.test(text.slice(i + 1, i + 3))) {
      bytes.push(parseInt(text.slice(i + 1, i + 3), 16));
      i += 2;
    } else {
      const code = text.codePointAt(i);
      bytes.push(...utf8.encode(String.fromCodePoint(code)));
      if (code > 0xffff) i++;
    }
  }
  let out = "";
  for (let i = 0; i < bytes.length; ) {
    const b = bytes[i];
    const n = b < 0x80 ? 1 : b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 0;
    if (n === 0 || i + n > bytes.length) {
      out += "\ufffd";
      i++;
      continue;
    }
    let code = n === 1 ? b : b & (0xff >> (n + 1));
    for (let k = 1; k < n; k++) code = (code << 6) | (bytes[i + k] & 0x3f);
    out += code <= 0x10ffff ? String.fromCodePoint(code) : "\ufffd";
    i += n;
  }
  return out;
}

// The `name=value` pairs of the address's hash, read back with `dec`.
function hashParams() {
  const params = new Map();
  for (const part of location.hash.slice(1).split("&")) {
    const at = part.indexOf("=");
    if (at > 0) params.set(dec(part.slice(0, at)), dec(part.slice(at + 1)));
  }
  return params;
}

async function getJSON(path, params) {
  const query = params
    ? "?" + Object.entries(params).map(([k, v]) => enc(k) + "=" + enc(String(v))).join("&")
    : "";
  const response = await fetch(path + query);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return (i === 0 ? String(v) : v.toFixed(2)) + " " + units[i];
}

// ---------------------------------------------------------------- figures

function addFigure(list, name, value, key) {
  const item = el("div");
  if (key) item.dataset.key = key;
  item.append(el("dt", null, name), el("dd", null, value));
  list.append(item);
  return item;
}

function showLabels(labels) {
  const box = document.getElementById("labels");
  box.replaceChildren();
  if (labels === null || labels === undefined) return;
  const items = Array.isArray(labels)
    ? labels
    : typeof labels === "object"
      ? Object.entries(labels).map(([k, v]) => k + ": " + (typeof v === "string" ? v : JSON.stringify(v)))
      : [labels];
  for (const label of items) box.append(el("span", "badge label", typeof label === "string" ? label : JSON.stringify(label)));
}

function showSessions(sessions) {
  const nav = document.getElementById("sessions");
  nav.replaceChildren();
  nav.hidden = !sessions || sessions.length === 0;
  if (nav.hidden) return;
  nav.append(el("span", "hint", plural(sessions.length, "session") + ": "));
  for (const s of sessions) {
    const link = el("a", "session-link", s.id);
    link.href = "#session=" + enc(s.id);
    link.title = plural(s.turns, "turn") + ", first " + s.first;
    link.dataset.session = s.id;
    nav.append(link, " ");
  }
}

function showFigures(f) {
  document.getElementById("title").textContent = f.title;
  document.title = f.title + " - rollout viewer";
  showLabels(f.labels);
  showSessions(f.sessions);
  hasTokens = f.tokens_received > 0;
  document.getElementById("token-hint").hidden = !hasTokens;
  const list = document.getElementById("figures");
  list.replaceChildren();
  addFigure(list, "turns", f.turns, "turns");
  addFigure(list, "roots", f.roots, "roots");
  addFigure(list, "forks", f.forks, "forks");
  addFigure(list, "discarded", f.discarded, "discarded");
  if (f.drift) addFigure(list, "token drift", f.drift, "drift");
  const exportItem = addFigure(list, "received (plain export)", "", "received");
  if (f.file_bytes !== null) addFigure(list, "stored (file)", fmtBytes(f.file_bytes), "stored");
  addFigure(list, "long strings, unique", fmtBytes(f.unique_blob_bytes), "unique");
  addFigure(list, "long strings, sent", fmtBytes(f.blob_bytes_sent), "sent");
  if (hasTokens) addFigure(list, "tokens received / stored", f.tokens_received + " / " + f.tokens_stored, "tokens");
  const button = el("button", null, "measure");
  button.title = "Stream the plain JSON export with every message and count its bytes";
  button.addEventListener("click", async () => {
    button.disabled = true;
    button.textContent = "measuring...";
    const r = await getJSON("api/export-size");
    let text = fmtBytes(r.plain_export_bytes);
    if (f.file_bytes) text += ", " + (r.plain_export_bytes / f.file_bytes).toFixed(1) + "x the file";
    exportItem.querySelector("dd").textContent = text;
  });
  exportItem.querySelector("dd").append(button);
  return button;
}

// ---------------------------------------------------------------- the tree

function loadPage(index) {
  let entry = pages.get(index);
  if (!entry) {
    entry = getJSON("api/rows", { offset: index * PAGE, limit: PAGE }).then((r) => {
      pages.set(index, r.rows);
      return r.rows;
    });
    pages.set(index, entry);
  }
  return Promise.resolve(entry);
}

function rowElement(row, position) {
  const div = el("div", "row");
  div.style.top = position * ROW_HEIGHT + "px";
  div.style.paddingLeft = 8 + Math.min(row.indent, MAX_INDENT) * 16 + "px";
  div.dataset.id = row.id;
  if (row.id === selectedId) div.classList.add("selected");
  if (row.discarded) div.classList.add("is-discarded");
  // a child of a fork: drawn as a branch of its parent, its siblings at the same depth
  if (row.branch) {
    const mark = { last: "\u2514 ", sibling: "\u251c ", through: "\u2502 " }[row.branch] || "";
    const glyph = el("span", "branch", mark);
    glyph.title = row.branch === "through"
      ? "the chain goes on; a sibling of the turn it started from follows"
      : "one of the children of " + row.parent;
    div.append(glyph);
  }
  if (row.indent > MAX_INDENT) div.append(el("span", "badge", "depth " + row.indent));
  if (row.parent === null) div.append(el("span", "badge root", "root"));
  if (row.parent === null && row.session !== null && row.session !== undefined) {
    div.append(el("span", "badge session", "session " + row.session));
  }
  if (row.children > 1) div.append(el("span", "badge fork", "fork x" + row.children));
  if (row.discarded) div.append(el("span", "badge discarded", "discarded"));
  if (row.drift) div.append(driftBadge(row.drift));
  div.append(el("span", "id", row.id));
  if (row.parent !== null) div.append(el("span", "badge link", row.link));
  if (row.n_prompt || row.n_sampled) div.append(el("span", "tokens", "p " + row.n_prompt + " s " + row.n_sampled));
  if (row.preview) div.append(el("span", "preview", row.preview));
  div.addEventListener("click", () => {
    selectedIndex = position;
    selectTurn(row.id);
  });
  return div;
}

let drawToken = 0;
async function drawTree() {
  const tree = document.getElementById("tree");
  const token = ++drawToken;
  const first = Math.max(0, Math.floor(tree.scrollTop / ROW_HEIGHT) - 5);
  const last = Math.min(totalRows, Math.ceil((tree.scrollTop + tree.clientHeight) / ROW_HEIGHT) + 5);
  const wanted = [];
  for (let p = Math.floor(first / PAGE); p * PAGE < last; p += 1) wanted.push(loadPage(p));
  const loaded = await Promise.all(wanted);
  if (token !== drawToken) return; // a newer scroll position won
  const spacer = document.getElementById("tree-spacer");
  const nodes = [spacer];
  const base = Math.floor(first / PAGE) * PAGE;
  const rows = loaded.flat();
  for (let i = first; i < last; i += 1) {
    const row = rows[i - base];
    if (row) nodes.push(rowElement(row, i));
  }
  tree.replaceChildren(...nodes);
}

// ---------------------------------------------------------------- content

function pretty(value) {
  return el("pre", "json", JSON.stringify(value, null, 2));
}

function prettyArguments(args) {
  if (typeof args === "string") {
    try {
      return el("pre", "arguments", JSON.stringify(JSON.parse(args), null, 2));
    } catch (_) {
      return el("pre", "arguments", args);
    }
  }
  return el("pre", "arguments", JSON.stringify(args, null, 2));
}

function isDataImage(url) {
  return typeof url === "string" && /^data:image\/[a-z0-9.+-]+;base64,/i.test(url);
}

function image(src, alt) {
  // a thumbnail; a click opens the image full size over the page (Escape or a click closes)
  const img = el("img", "content-image");
  img.alt = alt;
  img.src = src;
  img.title = "click to open full size";
  img.addEventListener("click", () => openImage(src, alt));
  return img;
}

function openImage(src, alt) {
  const overlay = el("div", "lightbox");
  const full = el("img", "full-image");
  full.alt = alt;
  full.src = src;
  overlay.append(full, el("div", "hint", "click or press Escape to close"));
  const close = () => {
    overlay.remove();
    document.removeEventListener("keydown", onKey);
  };
  const onKey = (event) => {
    if (event.key === "Escape") close();
  };
  overlay.addEventListener("click", close);
  document.addEventListener("keydown", onKey);
  document.body.append(overlay);
}

function imageFromUrl(url) {
  if (isDataImage(url)) return image(url, "image");
  // A remote image would reach the network: show its address as text instead.
  return el("div", "text remote-image", "[image at " + url + "]");
}

function textBlock(text) {
  // Long texts (system prompts, tool outputs) show their start and a button for the rest.
  if (text.length <= LONG_TEXT) return el("div", "text", text);
  const box = el("div", "text long", text.slice(0, LONG_TEXT) + " ...");
  const more = el("button", null, "show all " + text.length + " characters");
  more.addEventListener("click", () => box.replaceChildren(text));
  const wrap = el("div");
  wrap.append(box, more);
  return wrap;
}

function renderPart(part) {
  if (typeof part === "string") return textBlock(part);
  if (part === null || typeof part !== "object") return pretty(part);
  const type = part.type;
  if ((type === "text" || type === "input_text" || type === "output_text") && typeof part.text === "string") {
    return textBlock(part.text);
  }
  if (type === "image_url" && part.image_url) {
    const url = typeof part.image_url === "string" ? part.image_url : part.image_url.url;
    return imageFromUrl(url);
  }
  if (type === "input_image" && (part.image_url || part.url)) {
    return imageFromUrl(part.image_url || part.url);
  }
  if (type === "image" && part.source && part.source.type === "base64") {
    const media = String(part.source.media_type || "image/png");
    const src = "data:" + media + ";base64," + part.source.data;
    if (isDataImage(src)) return image(src, "image");
  }
  const inline = part.inline_data || part.inlineData;
  if (inline && typeof inline.data === "string") {
    const src = "data:" + String(inline.mime_type || inline.mimeType) + ";base64," + inline.data;
    if (isDataImage(src)) return image(src, "image");
  }
  if (type === "tool_use") {
    const box = el("div", "call");
    box.append(el("span", "name", part.name), el("span", "hint", " " + (part.id || "")));
    box.append(prettyArguments(part.input));
    return box;
  }
  if (type === "tool_result") {
    const box = el("div", "call tool-result");
    box.append(el("span", "hint", "result of " + (part.tool_use_id || "")));
    box.append(renderContent(part.content));
    return box;
  }
  return pretty(part);
}

function renderContent(content) {
  const box = el("div", "content");
  if (content === null || content === undefined) return box;
  if (Array.isArray(content)) {
    for (const part of content) box.append(renderPart(part));
  } else {
    box.append(renderPart(content));
  }
  return box;
}

function renderMessage(message, label, extraClass) {
  const box = el("div", "message" + (extraClass ? " " + extraClass : ""));
  if (message === null || typeof message !== "object" || Array.isArray(message)) {
    box.append(el("div", "role", label), pretty(message));
    return box;
  }
  const role = String(message.role || "?");
  box.classList.add("role-" + role.replace(/[^a-z]/gi, ""));
  let head = label + role;
  if (message.name) head += " (" + message.name + ")";
  if (message.tool_call_id) head += " for " + message.tool_call_id;
  box.append(el("div", "role", head));
  box.append(renderContent(message.content));
  // tool_calls of another shape than a list (an engine's bug, recorded as it came) are
  // shown with the other fields, as they are
  const calls = Array.isArray(message.tool_calls) ? message.tool_calls : [];
  for (const call of calls) {
    const box2 = el("div", "call");
    const fn = (call && typeof call === "object" && (call.function || call)) || {};
    box2.append(el("span", "name", fn.name), el("span", "hint", " " + ((call && call.id) || "")));
    box2.append(prettyArguments(fn.arguments));
    box.append(box2);
  }
  const known = new Set(["role", "content", "name", "tool_call_id"]);
  if (Array.isArray(message.tool_calls)) known.add("tool_calls");
  const rest = Object.keys(message).filter((k) => !known.has(k));
  if (rest.length) {
    const extra = {};
    for (const k of rest) extra[k] = message[k];
    const details = el("details");
    details.append(el("summary", "hint", "other fields: " + rest.join(", ")), pretty(extra));
    box.append(details);
  }
  return box;
}

function renderMask(sequence) {
  const box = el("div", "sequence");
  if (sequence.n_tokens === 0) {
    box.append(el("div", "hint", "no token ids were recorded for this path (a text capture): there is no training sequence to show"));
    return box;
  }
  box.append(
    el(
      "div",
      null,
      plural(sequence.n_tokens, "token") + " over " + plural(sequence.n_turns, "turn") + ", " +
        sequence.n_trained + " trained (loss mask 1), first prompt " + plural(sequence.prompt_len, "token")
    )
  );
  {
    const bar = el("div", "mask");
    bar.title = "grey: context (mask 0), blue: sampled tokens trained on (mask 1)";
    for (const [value, length] of sequence.mask_runs) {
      const span = el("span", "m" + value);
      span.style.flex = String(length);
      span.title = (value ? "trained" : "context") + ": " + length + " tokens";
      bar.append(span);
    }
    box.append(bar);
    const legend = el("div", "mask-legend");
    legend.append(
      el("span", "swatch m0"), el("span", null, "context: 0, not trained (prompts, tool results)"),
      el("span", "swatch m1"), el("span", null, "sampled by the model: 1, trained on")
    );
    box.append(legend);
    const runs = sequence.mask_runs.slice(0, 40).map(([v, n]) => v + "x" + n).join(" ");
    box.append(el("div", "hint mask-runs", "mask runs: " + runs + (sequence.mask_runs.length > 40 ? " ..." : "")));
    box.append(el("div", "hint", "each run is value x length: 0x40 is 40 tokens of context, 1x3 three trained tokens, in order"));
  }
  return box;
}

function metaTable(pairs) {
  const table = el("table", "meta");
  for (const [name, value] of pairs) {
    const tr = el("tr");
    tr.append(el("td", null, name), el("td", null, value === null || value === undefined ? "-" : value));
    table.append(tr);
  }
  return table;
}

function historyLine(message, label) {
  // an earlier message, one line (its text's start, its images as thumbnails): a click
  // shows it whole
  const box = el("div", "message history-line");
  const role = message && typeof message === "object" && !Array.isArray(message) ? String(message.role || "?") : "?";
  box.classList.add("role-" + role.replace(/[^a-z]/gi, ""));
  const head = el("div", "role", label + role);
  const summary = el("span", "summary-text", summaryText(message));
  head.append(" ", summary);
  box.append(head);
  for (const src of imageSources(message)) box.append(image(src, "image"));
  box.addEventListener("click", (event) => {
    if (event.target.tagName === "IMG") return;
    box.replaceWith(renderMessage(message, label));
  });
  box.title = "click to show the whole message";
  return box;
}

function summaryText(message) {
  if (message === null || typeof message !== "object") return String(message);
  const parts = [];
  const content = message.content;
  if (typeof content === "string") parts.push(content);
  else if (Array.isArray(content)) {
    for (const part of content) {
      if (typeof part === "string") parts.push(part);
      else if (part && typeof part.text === "string") parts.push(part.text);
      else if (part && part.type === "tool_use") parts.push("-> " + part.name + "()");
      else if (part && part.type === "tool_result") parts.push("[result of " + part.tool_use_id + "]");
    }
  }
  if (Array.isArray(message.tool_calls)) {
    for (const call of message.tool_calls) parts.push("-> " + ((call && (call.function || call).name) || "?") + "()");
  }
  const text = parts.join(" ").replace(/\s+/g, " ").trim();
  return text.length > 160 ? text.slice(0, 160) + " ..." : text;
}

function imageSources(message) {
  const found = [];
  const visit = (part) => {
    if (!part || typeof part !== "object") return;
    if (Array.isArray(part)) return part.forEach(visit);
    if (part.type === "image_url" && part.image_url) {
      const url = typeof part.image_url === "string" ? part.image_url : part.image_url.url;
      if (isDataImage(url)) found.push(url);
    } else if (part.type === "input_image" && isDataImage(part.image_url || part.url)) {
      found.push(part.image_url || part.url);
    } else if (part.type === "image" && part.source && part.source.type === "base64") {
      const src = "data:" + String(part.source.media_type || "image/png") + ";base64," + part.source.data;
      if (isDataImage(src)) found.push(src);
    } else if ((part.inline_data || part.inlineData) && typeof (part.inline_data || part.inlineData).data === "string") {
      const inline = part.inline_data || part.inlineData;
      const src = "data:" + String(inline.mime_type || inline.mimeType) + ";base64," + inline.data;
      if (isDataImage(src)) found.push(src);
    } else if (part.type === "tool_result") {
      visit(part.content);
    }
  };
  if (message && typeof message === "object") visit(message.content);
  return found;
}

function driftBadge(d) {
  // its messages continue a turn its token ids do not extend (see Graph.drift)
  const badge = el("span", "badge drift", "drift @" + d.offset);
  const where = d.message_index === null ? "the prompt" : "message " + d.message_index;
  badge.title = "continues " + d.would_be_parent + " by messages; tokens differ at " +
    d.offset + " of " + d.parent_tokens + " (in " + where + ")";
  return badge;
}

async function selectTurn(id, options) {
  selectedId = id;
  for (const row of document.querySelectorAll(".row")) {
    row.classList.toggle("selected", row.dataset.id === id);
  }
  const t = await getJSON("api/turn", { id });
  if (selectedId !== id) return;
  if (!(options && options.keepHash)) window.history.replaceState(null, "", "#turn=" + enc(id));
  if (t.position !== null && t.position !== undefined) selectedIndex = t.position;
  const pane = document.getElementById("turn");
  const s = t.summary;
  const heading = el("h2", null, s.node_id);
  if (t.discarded) heading.append(" ", el("span", "badge discarded", "discarded"));
  if (s.parent_id === null) heading.append(" ", el("span", "badge root", "root"));
  if (t.children.length > 1) heading.append(" ", el("span", "badge fork", "fork x" + t.children.length));
  const link = el("a", "permalink", "link to this turn");
  link.href = "#turn=" + enc(id);
  heading.append(" ", link);
  if (t.drift) heading.append(" ", driftBadge(t.drift));
  const nodes = [heading];
  const n_new = t.n_messages - t.new_from;
  const meta = [
    ["parent", s.parent_id === null ? "none (root)" : s.parent_id + " (linked by " + s.link + ")"],
    ["children", t.children.length ? t.children.join(", ") : "none"],
    ["model", s.model],
    ["finish reason", s.finish_reason],
    ["session", s.harness_session_id],
  ];
  if (s.n_prompt || s.n_sampled) meta.push(["prompt tokens", s.n_prompt], ["sampled tokens", s.n_sampled]);
  if (t.timeline) {
    const tl = t.timeline;
    meta.push(
      ["engine", tl.engine_ms.toFixed(1) + " ms (first byte after " + (tl.first_byte_ms - tl.upstream_sent_ms).toFixed(1) + " ms)"],
      ["reply sent after", tl.reply_sent_ms.toFixed(1) + " ms" + (tl.chunks ? " (" + tl.chunks + " chunks, largest gap " + tl.max_chunk_gap_ms.toFixed(1) + " ms)" : "")],
      ["agent and tools before", tl.gap_before_ms === null ? "-" : tl.gap_before_ms.toFixed(1) + " ms"],
    );
    if (tl.failed_attempts) meta.push(["failed attempts before", tl.failed_attempts + " (last: HTTP " + tl.last_failed_status + ")"]);
  }
  meta.push(["request messages", t.n_messages + " (" + n_new + " new in this turn)"], ["tools", s.n_tools]);
  nodes.push(metaTable(meta));

  // what is new in this turn first: its new request messages, then the response
  nodes.push(el("h3", null, n_new ? "new in this turn: " + plural(n_new, "message") + " and the response" : "the response (no new request messages)"));
  const fresh = el("div", "messages new-messages");
  const past = el("div", "messages history");
  let start = t.start;
  let stop = t.start + t.messages.length;
  const number = (i) => "#" + i + (i >= t.new_from ? " new: " : ": ");
  const place = (m, i) => {
    if (i >= t.new_from) fresh.append(renderMessage(m, number(i)));
    else past.append(historyLine(m, number(i)));
  };
  t.messages.forEach((m, i) => place(m, start + i));
  const later = el("button", null, "");
  later.addEventListener("click", async () => {
    const r = await getJSON("api/messages", { id, start: stop, stop: stop + 100 });
    r.messages.forEach((m, i) => place(m, stop + i));
    stop += r.messages.length;
    refresh();
  });
  nodes.push(fresh, later, renderMessage(t.response, "response: ", "response"));

  // the history the turn was sent, collapsed: one line a message, opened on a click
  let refreshEarlier = () => {};
  if (t.new_from > 0) {
    nodes.push(el("h3", null, "history: " + plural(t.new_from, "earlier message") + " (click one to open it)"));
    const earlier = el("button", null, "");
    earlier.addEventListener("click", async () => {
      const from = Math.max(0, start - 100);
      const r = await getJSON("api/messages", { id, start: from, stop: start });
      past.prepend(...r.messages.map((m, i) => historyLine(m, number(from + i))));
      start = from;
      refresh();
    });
    nodes.push(earlier, past);
    refreshEarlier = () => {
      earlier.textContent = "show " + plural(Math.min(start, 100), "earlier message") + " (" + start + " before)";
      earlier.hidden = start === 0;
    };
  }
  const refresh = () => {
    refreshEarlier();
    later.textContent = "show " + plural(Math.min(t.n_messages - stop, 100), "more message") + " (" + (t.n_messages - stop) + " after)";
    later.hidden = stop >= t.n_messages;
  };
  refresh();

  nodes.push(el("h3", null, "training sequence ending here"), renderMask(t.sequence));
  if (t.sampling_params !== null) {
    const details = el("details");
    details.append(el("summary", null, "sampling parameters"), pretty(t.sampling_params));
    nodes.push(details);
  }
  if (t.tools !== null) {
    const details = el("details");
    details.append(el("summary", null, "tools (" + (Array.isArray(t.tools) ? t.tools.length : 1) + ")"), pretty(t.tools));
    nodes.push(details);
  }
  pane.replaceChildren(...nodes);
  pane.scrollTop = 0;
  pane.dataset.turn = id;
}

// Up and down arrows (or k and j) in the tree move the selection one row.
async function moveSelection(step) {
  const index = Math.max(0, Math.min(totalRows - 1, selectedIndex + step));
  if (index === selectedIndex && selectedId !== null) return;
  const rows = await loadPage(Math.floor(index / PAGE));
  const row = rows[index % PAGE];
  if (!row) return;
  selectedIndex = index;
  const tree = document.getElementById("tree");
  const top = index * ROW_HEIGHT;
  if (top < tree.scrollTop) tree.scrollTop = top;
  else if (top + ROW_HEIGHT > tree.scrollTop + tree.clientHeight) {
    tree.scrollTop = top + ROW_HEIGHT - tree.clientHeight;
  }
  await drawTree();
  await selectTurn(row.id);
}

// ---------------------------------------------------------------- the address

// `#turn=ID` selects that turn; `#session=ID` the first turn of that harness session. The
// page keeps the address of the turn on screen, so a reload or a shared link shows it again.
async function followHash(figures) {
  const params = hashParams();
  let id = params.has("turn") ? params.get("turn") : null;
  const session = params.has("session") ? params.get("session") : null;
  if (id === null && session !== null) {
    const found = (figures.sessions || []).find((s) => String(s.id) === session);
    if (!found) return false;
    id = found.first;
  }
  if (id === null || id === selectedId) return id !== null;
  try {
    await selectTurn(id, { keepHash: session !== null });
  } catch (error) {
    document.getElementById("turn").replaceChildren(el("p", "error", "No turn " + id + ": " + error.message));
    return true;
  }
  scrollToRow(selectedIndex);
  await drawTree();
  return true;
}

function scrollToRow(index) {
  const tree = document.getElementById("tree");
  const top = index * ROW_HEIGHT;
  if (top < tree.scrollTop || top + ROW_HEIGHT > tree.scrollTop + tree.clientHeight) {
    tree.scrollTop = Math.max(0, top - tree.clientHeight / 3);
  }
}

// ---------------------------------------------------------------- timeline

// A lane per harness session: each call from its request received to its reply sent (the
// engine's part darker), the wait before it (the agent's and its tools' time) lighter.
async function drawTimeline() {
  const t = await getJSON("api/timeline");
  const section = document.getElementById("timeline");
  if (!t.calls) return;
  const span = Math.max(t.span_ms, 0.001);
  const pct = (ms) => (100 * ms / span).toFixed(3) + "%";
  let engine = 0, tools = 0;
  const lanes = t.lanes.map((lane) => {
    const row = el("div", "lane");
    row.append(el("span", "lane-name", lane.session === null ? "calls" : String(lane.session)));
    const bar = el("div", "lane-bar");
    for (const c of lane.calls) {
      engine += c.engine_to_ms - c.engine_from_ms;
      if (c.tools_ms !== null) {
        tools += c.tools_ms;
        const gap = el("span", "seg tools");
        gap.style.left = pct(c.start_ms - c.tools_ms);
        gap.style.width = pct(c.tools_ms);
        gap.title = "agent and tools before " + c.id + ": " + c.tools_ms.toFixed(1) + " ms";
        bar.append(gap);
      }
      const call = el("span", "seg call" + (c.failed ? " retried" : ""));
      call.style.left = pct(c.start_ms);
      call.style.width = pct(c.end_ms - c.start_ms);
      const inner = el("span", "seg engine");
      const width = Math.max(c.end_ms - c.start_ms, 0.001);
      inner.style.left = (100 * (c.engine_from_ms - c.start_ms) / width).toFixed(3) + "%";
      inner.style.width = (100 * (c.engine_to_ms - c.engine_from_ms) / width).toFixed(3) + "%";
      call.append(inner);
      call.title = c.id + ": " + (c.end_ms - c.start_ms).toFixed(1) + " ms, engine " + (c.engine_to_ms - c.engine_from_ms).toFixed(1) + " ms" + (c.chunks ? ", " + c.chunks + " chunks" : "") + (c.failed ? ", " + c.failed + " failed attempts before" : "");
      call.dataset.id = c.id;
      call.addEventListener("click", () => selectTurn(c.id));
      bar.append(call);
    }
    row.append(bar);
    return row;
  });
  const head = el("div", "lane-head", plural(t.calls, "timed call") + " over " + (span / 1000).toFixed(2) + " s: engine " + (engine / 1000).toFixed(2) + " s, agent and tools " + (tools / 1000).toFixed(2) + " s");
  section.replaceChildren(head, ...lanes);
  section.hidden = false;
}

// ---------------------------------------------------------------- start

async function start() {
  const figures = await getJSON("api/figures");
  const measure = showFigures(figures);
  totalRows = figures.rows;
  document.getElementById("tree-spacer").style.height = totalRows * ROW_HEIGHT + "px";
  const tree = document.getElementById("tree");
  tree.addEventListener("scroll", () => drawTree(), { passive: true });
  tree.addEventListener("keydown", (event) => {
    const step = { ArrowDown: 1, j: 1, ArrowUp: -1, k: -1 }[event.key];
    if (step === undefined) return;
    event.preventDefault();
    moveSelection(step);
  });
  window.addEventListener("resize", () => drawTree());
  window.addEventListener("hashchange", () => followHash(figures));
  await drawTree();
  if (figures.timed) await drawTimeline();
  if (!(await followHash(figures)) && totalRows > 0) {
    const rows = await loadPage(0);
    await selectTurn(rows[0].id, { keepHash: true });
  }
  document.body.dataset.openMs = String(Math.round(performance.now()));
  document.body.dataset.ready = "1";
  // The received bytes cost a pass over every message: measured at once for small rollouts,
  // after the page is ready; larger ones wait for the button.
  if (figures.turns <= AUTO_MEASURE_TURNS) measure.click();
}

start().catch((error) => {
  document.body.dataset.error = String(error);
  document.getElementById("turn").replaceChildren(el("p", "error", "Could not load: " + error));
});
