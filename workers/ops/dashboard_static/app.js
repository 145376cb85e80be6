"use strict";
// The agentpool dashboard. Run data is untrusted (model and tool text): every piece of it goes into the
// page through textContent / text nodes built by h(), never through innerHTML.

const TOKEN_KEY = "agentpool.dashboard.token";
const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const LIST_POLL_MS = 2000;
const RUN_POLL_MS = 1000;
const MAX_EVENTS_SHOWN = 500;
const TIMELINE_EVERY_MS = 2000;
const MAX_TIMELINE_TURNS = 200;
const SVG_NS = "http://www.w3.org/2000/svg";

// ---------------------------------------------------------------------------------------------
// helpers

function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "value") el.value = value;
    // Through CSSOM: the page's CSP (style-src 'self') refuses a style attribute.
    else if (key === "style") Object.assign(el.style, value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

// An SVG element; its text goes in as a text node, like everything else.
function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) el.setAttribute(key, String(value));
  }
  for (const child of children) el.append(child instanceof Node ? child : String(child));
  return el;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function runHref(id) {
  return "/runs/" + encodeURIComponent(id);
}

function fmtAge(seconds) {
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (seconds >= size) return Math.floor(seconds / size) + unit;
  }
  return Math.max(0, Math.floor(seconds)) + "s";
}

function fmtTime(epochSeconds) {
  if (!epochSeconds) return "";
  return new Date(epochSeconds * 1000).toLocaleString();
}

function fmtNum(n) {
  return Number(n || 0).toLocaleString("en-US");
}

function fmtUsd(usd) {
  const n = Number(usd || 0);
  return "$" + (n > 0 && n < 0.01 ? n.toFixed(4) : n.toFixed(2));
}

function pretty(value) {
  if (typeof value === "string") return value;
  try {
    return JSON.stringify(value, null, 2);
  } catch (e) {
    return String(value);
  }
}

function badge(status) {
  return h("span", { class: "badge st-" + status }, status);
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---------------------------------------------------------------------------------------------
// server, token, connection state

function takeTokenFromUrl() {
  const url = new URL(location.href);
  const token = url.searchParams.get("token");
  if (token) {
    sessionStorage.setItem(TOKEN_KEY, token);
    url.searchParams.delete("token");
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
}

function setConn(ok, text) {
  const el = document.getElementById("conn");
  el.className = "conn " + (ok ? "ok" : "down");
  el.textContent = ok ? "live" : text || "offline";
}

async function api(path, options = {}) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers["Authorization"] = "Bearer " + token;
  const init = { method: options.method || "GET", headers, cache: "no-store" };
  if (options.body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(options.body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    setConn(false, "server unreachable");
    throw new ApiError(0, "the dashboard server is unreachable");
  }
  let doc = {};
  try {
    doc = await resp.json();
  } catch (e) {
    doc = {};
  }
  if (resp.status === 401) askForToken("The dashboard refused the token. Enter it again.");
  // A 503 names what is down (Redis, or on a sharded pool the run's shard); without a name, the server is full.
  if (resp.status >= 500) setConn(false, resp.status !== 503 ? "server error" : doc.unavailable ? doc.unavailable + " unavailable" : "server busy");
  else setConn(true);
  if (!resp.ok) throw new ApiError(resp.status, doc.error || resp.statusText);
  return doc;
}

function renderAuth(config) {
  const slot = document.getElementById("auth");
  slot.replaceChildren();
  if (!config.token_required) return;
  if (sessionStorage.getItem(TOKEN_KEY)) {
    slot.append(h("button", {
      class: "link", type: "button", title: "Forget the token kept in this tab",
      onclick: () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); },
    }, "forget token"));
  }
}

function askForToken(message) {
  const banner = document.getElementById("banner");
  if (!banner.hidden && document.getElementById("token-input")) return; // already asking: keep what is typed
  const input = h("input", { type: "password", id: "token-input", autocomplete: "off", placeholder: "dashboard token" });
  const form = h("form", {
    class: "token-form",
    onsubmit: (ev) => {
      ev.preventDefault();
      if (!input.value) return;
      sessionStorage.setItem(TOKEN_KEY, input.value);
      location.reload();
    },
  }, h("span", {}, message), input, h("button", { type: "submit" }, "Use token"));
  banner.replaceChildren(form);
  banner.hidden = false;
  input.focus();
}

function showError(container, err) {
  container.replaceChildren(h("p", { class: "error-text" }, err.message || String(err)));
}

// A refresh function returns the delay before the next call, or null to stop; kick() runs it now.
function poller(refresh) {
  let timer = null;
  let running = false;
  let again = false; // kicked while a refresh was in flight: its answer may predate the kick
  async function tick() {
    if (running) {
      again = true;
      return;
    }
    running = true;
    clearTimeout(timer);
    let next;
    try {
      next = await refresh();
    } catch (err) {
      next = err.status === 404 || err.status === 401 ? null : 3000; // 401: the token form reloads the page
    }
    running = false;
    if (again) {
      again = false;
      next = 0;
    }
    if (next !== null && next !== undefined) timer = setTimeout(tick, document.hidden ? Math.max(next, 5000) : next);
  }
  tick();
  return { kick: tick };
}

// ---------------------------------------------------------------------------------------------
// the runs list

function listPage(app) {
  const params = new URLSearchParams(location.search);
  const filters = { status: params.get("status") || "", agent: params.get("agent") || "" };
  const knownAgents = new Set(filters.agent ? [filters.agent] : []);

  const statusSelect = h("select", { id: "filter-status", "aria-label": "status" }, h("option", { value: "" }, "All statuses"));
  const agentSelect = h("select", { id: "filter-agent", "aria-label": "agent" }, h("option", { value: "" }, "All agents"));
  const summary = h("span", { class: "muted", id: "runs-summary" });
  const tbody = h("tbody");
  const table = h("table", { id: "runs-table", class: "runs" },
    h("thead", {}, h("tr", {},
      h("th", {}, "Run"), h("th", {}, "Agent"), h("th", {}, "Queue"), h("th", {}, "Status"), h("th", { class: "num" }, "Turns"),
      h("th", { class: "num" }, "Tokens"), h("th", { class: "num" }, "Cost"), h("th", { class: "num" }, "Age"),
      h("th", {}, "Note"))),
    tbody);

  function onFilter() {
    filters.status = statusSelect.value;
    filters.agent = agentSelect.value;
    const q = new URLSearchParams();
    if (filters.status) q.set("status", filters.status);
    if (filters.agent) q.set("agent", filters.agent);
    history.replaceState(null, "", "/" + (q.toString() ? "?" + q : ""));
    tbody.replaceChildren();
    poll.kick();
  }
  statusSelect.addEventListener("change", onFilter);
  agentSelect.addEventListener("change", onFilter);

  app.replaceChildren(
    h("section", { class: "card" },
      h("div", { class: "toolbar" }, h("h1", {}, "Runs"), h("span", { class: "spacer" }), statusSelect, agentSelect),
      h("div", { class: "table-wrap" }, table),
      h("p", { class: "footnote" }, summary)));

  function fillSelect(select, values, current) {
    const have = [...select.options].map((o) => o.value);
    for (const v of values) if (!have.includes(v)) select.append(h("option", { value: v }, v));
    select.value = current;
  }

  function row(run) {
    const note = run.status === "waiting_approval"
      ? h("span", { class: "note-warn" }, "awaiting approval")
      : run.note ? h("span", { class: "note-warn", title: run.note }, run.note)
        : run.error ? h("span", { class: "note", title: run.error }, run.error) : "";
    return h("tr", { dataset: { runId: run.id }, class: "clickable", onclick: (ev) => {
      if (ev.target.closest("a") === null) location.href = runHref(run.id);
    } },
      h("td", { class: "mono" }, h("a", { href: runHref(run.id) }, run.id)),
      h("td", { class: "agent" }, run.agent),
      h("td", { class: "queue mono" }, run.queue || "default",
        run.shard === undefined ? null : h("span", { class: "shard muted small" }, " · shard " + run.shard)),
      h("td", { class: "status" }, badge(run.status)),
      h("td", { class: "num turns" }, run.turns),
      h("td", { class: "num tokens" }, fmtNum(run.tokens)),
      h("td", { class: "num cost" }, run.cost_usd === null || run.cost_usd === undefined ? "—" : fmtUsd(run.cost_usd)),
      h("td", { class: "num age", title: fmtTime(run.created_at) }, fmtAge(run.age)),
      h("td", { class: "note-cell" }, note));
  }

  async function refresh() {
    const q = new URLSearchParams({ limit: "100" });
    if (filters.status) q.set("status", filters.status);
    if (filters.agent) q.set("agent", filters.agent);
    const doc = await api("/api/runs?" + q);
    fillSelect(statusSelect, doc.statuses, filters.status);
    for (const a of doc.agents) knownAgents.add(a);
    fillSelect(agentSelect, [...knownAgents].sort(), filters.agent);
    if (doc.runs.length === 0) {
      tbody.replaceChildren(h("tr", {}, h("td", { colspan: "9", class: "empty" },
        filters.status || filters.agent ? "No runs match these filters." :
          "No runs yet. Enqueue one with: agentpool enqueue module:agent \"task\"")));
    } else {
      tbody.replaceChildren(...doc.runs.map(row));
    }
    summary.textContent = doc.runs.length + " run" + (doc.runs.length === 1 ? "" : "s") +
      " shown, newest first · updated " + new Date().toLocaleTimeString();
    const missing = doc.unavailable || [];
    if (missing.length) {  // a shard that did not answer: the others' runs are shown, its are not
      setConn(false, missing.length + " shard" + (missing.length === 1 ? "" : "s") + " unavailable");
      summary.textContent += " · not shown, did not answer: " + missing.join("; ");
    }
    return LIST_POLL_MS;
  }

  const poll = poller(refresh);
}

// ---------------------------------------------------------------------------------------------
// one run

function renderBlock(block, toolNames) {
  if (typeof block === "string") return h("div", { class: "text" }, block);
  switch (block.type) {
    case "text":
      return h("div", { class: "text" }, block.text);
    case "thinking":
      return h("details", { class: "thinking" }, h("summary", {}, "Thinking"), h("div", { class: "text" }, block.thinking));
    case "redacted_thinking":
      return h("div", { class: "muted small" }, "(redacted thinking)");
    case "compaction":
      return h("details", { class: "compaction" },
        h("summary", {}, "Compaction: the conversation so far, summarized by the API"),
        h("div", { class: "text" }, block.content === null || block.content === undefined ? "(compaction failed)" : block.content));
    case "tool_use":
      toolNames[block.id] = block.name;
      return h("div", { class: "tool-use", dataset: { toolUseId: block.id } },
        h("div", { class: "block-head" }, h("span", { class: "arrow" }, "→"), h("strong", {}, block.name),
          h("span", { class: "muted mono small" }, block.id)),
        h("pre", { class: "json" }, pretty(block.input)));
    case "tool_result": {
      const body = Array.isArray(block.content)
        ? block.content.map((b) => (b && b.type === "text" ? b.text : "(" + ((b && b.type) || "block") + ")")).join("\n")
        : pretty(block.content === undefined ? "" : block.content);
      return h("div", { class: "tool-result" + (block.is_error ? " is-error" : ""), dataset: { toolUseId: block.tool_use_id } },
        h("div", { class: "block-head" }, h("span", { class: "arrow" }, "←"),
          h("strong", {}, toolNames[block.tool_use_id] || "tool result"),
          block.is_error ? h("span", { class: "badge st-failed" }, "error") : null,
          h("span", { class: "muted mono small" }, block.tool_use_id)),
        h("pre", { class: "result" }, body));
    }
    case "image":
    case "document":
      return h("div", { class: "muted small" }, "(" + block.type + ")");
    default:
      return h("div", { class: "muted small" }, "(" + (block.type || "unknown block") + ")");
  }
}

function renderMessage(message, index, toolNames) {
  const blocks = typeof message.content === "string" ? [message.content] : message.content || [];
  const onlyResults = message.role === "user" && blocks.length > 0 &&
    blocks.every((b) => b && b.type === "tool_result");
  const label = message.role === "assistant" ? "Assistant" : onlyResults ? "Tool results" : index === 0 ? "Task" : "User";
  return h("article", { class: "msg " + (onlyResults ? "results" : message.role), dataset: { index: String(index) } },
    h("div", { class: "msg-head" }, h("span", { class: "role" }, label), h("span", { class: "muted small" }, "#" + index)),
    blocks.map((b) => renderBlock(b, toolNames)));
}

function fact(label, ...value) {
  return h("div", { class: "fact" }, h("dt", {}, label), h("dd", {}, ...value));
}

function runHeader(run, now) {
  const maxTurns = run.limits && run.limits.max_turns;
  const u = run.usage || {};
  return [
    h("div", { class: "run-title" },
      h("h1", { class: "mono", id: "run-id" }, run.id),
      h("span", { id: "run-status", class: "status" }, badge(run.status))),
    h("dl", { class: "facts" },
      fact("Agent", h("span", { class: "mono" }, run.agent)),
      fact("Queue", h("span", { class: "mono", id: "run-queue" }, run.queue || "default")),
      run.shard === undefined ? null : fact("Shard", h("span", { class: "mono", id: "run-shard" }, "shard " + run.shard)),
      run.forked_from ? fact("Forked from", h("a", { class: "mono", id: "forked-from", href: "/runs/" + encodeURIComponent(run.forked_from) },
        run.forked_from), " at turn " + run.forked_at) : null,
      fact("Turns", String(run.turns) + (maxTurns ? " / " + (maxTurns + ((run.limits || {}).extra_turns || 0)) : "")),
      fact("Tokens", fmtNum(run.tokens),
        h("span", { class: "muted small" }, "in " + fmtNum(u.input_tokens) + " · out " + fmtNum(u.output_tokens) +
          " · cache read " + fmtNum(u.cache_read_input_tokens) + " · cache write " + fmtNum(u.cache_creation_input_tokens))),
      run.cost_usd !== undefined && run.cost_usd !== null ? fact("Cost", fmtUsd(run.cost_usd)) : null,
      fact("Age", h("span", { title: fmtTime(run.created_at) }, fmtAge(run.age))),
      fact("Updated", h("span", { title: fmtTime(run.updated_at) }, fmtAge(Math.max(0, now - run.updated_at)) + " ago"))),
    waitingCallout(run.waiting, now),
    run.error ? h("div", { class: "callout " + (run.status === "stopped" ? "warn" : "bad"), id: "run-error" },
      h("strong", {}, run.status === "stopped" ? "Stopped: " : "Error: "), run.error) : null,
    run.result ? h("div", { class: "callout good", id: "run-result" }, h("strong", {}, "Result: "), run.result) : null,
    run.parent ? h("p", { class: "small", id: "run-parent" }, "Child run of ",
      h("a", { class: "mono", href: "/runs/" + encodeURIComponent(run.parent) }, run.parent), " (depth " + run.depth + ")") : null,
    run.tree && run.tree.length ? childTree(run.tree) : null,
  ];
}

// The run's child runs (sub-agents), nested, each with its status and cost (a child waiting for approval shows here).
function childTree(nodes) {
  const rows = (list, level) => list.flatMap((n) => [
    h("tr", { class: "child-run", dataset: { runId: n.id, status: n.status } },
      h("td", { class: "mono", style: { paddingLeft: 0.5 + level * 1.2 + "em" } },
        h("a", { href: "/runs/" + encodeURIComponent(n.id) }, n.id)),
      h("td", {}, badge(n.status), n.held_by ? h("span", { class: "muted small", title: "stopped until run " + n.held_by +
        " is resumed: its budget for itself and its sub-agents is used up" }, " held") : null),
      h("td", { class: "mono small" }, n.agent || ""),
      h("td", { class: "num cost" }, n.cost_usd === undefined ? "—" : fmtUsd(n.cost_usd))),
    ...rows(n.children || [], level + 1),
  ]);
  return h("section", { id: "child-runs" }, h("h2", {}, "Child runs"),
    h("table", {}, h("thead", {}, h("tr", {}, h("th", {}, "Run"), h("th", {}, "Status"), h("th", {}, "Agent"), h("th", {}, "Cost"))),
      h("tbody", {}, rows(nodes, 0))));
}

// Why a queued or running run is not moving, and since when (agentpool.runtime.progress).
function waitingCallout(waiting, now) {
  if (!waiting || waiting.kind === "in_progress") return null;
  const title = {
    handed_back: "Handed back: ", waiting_for_replica: "Waiting for a replica: ", backoff: "Backing off: ",
    queued: "Queued: ", lost: "Lost job: ",
  };
  const when = [];
  if (waiting.since) when.push("since " + fmtTime(waiting.since) + " (" + fmtAge(Math.max(0, now - waiting.since)) + ")");
  if (waiting.until) when.push("next try " + fmtTime(waiting.until));
  return h("div", { class: "callout warn", id: "run-waiting", dataset: { kind: waiting.kind } },
    h("strong", {}, title[waiting.kind] || "Waiting: "), waiting.note,
    when.length ? h("div", { class: "muted small" }, when.join(" · ")) : null);
}

function actionsPanel(run, post) {
  const out = [];
  if (run.status === "waiting_approval") {
    // Only the calls shown are decided, each by its id: a decision is never sent for calls nobody saw.
    const calls = run.pending || [];
    out.push(h("div", { class: "approval" },
      h("h2", {}, "Waiting for approval"),
      calls.length ? null : h("p", { class: "muted" }, "Its calls are being decided; the page shows them on its next refresh."),
      calls.map((call) => {
        const reason = h("input", { type: "text", class: "reason", placeholder: "reason (optional)", "aria-label": "reason" });
        const decide = (approved) => post("approve", { tool_use_id: call.id, approved, reason: reason.value || null },
          approved ? "Approved." : "Denied.");
        return h("div", { class: "pending-call", dataset: { toolUseId: call.id || "" } },
          h("div", { class: "block-head" }, h("strong", {}, call.name), h("span", { class: "muted mono small" }, call.id || "")),
          call.input !== null ? h("pre", { class: "json" }, pretty(call.input)) : null,
          h("div", { class: "buttons" },
            h("button", { type: "button", class: "primary", dataset: { action: "approve", toolUseId: call.id || "" },
              onclick: () => decide(true) }, "Approve"),
            h("button", { type: "button", class: "danger-outline", dataset: { action: "deny", toolUseId: call.id || "" },
              onclick: () => decide(false) }, "Deny"),
            reason));
      })));
  }
  const buttons = [];
  if (run.status === "stopped") {
    // Prefill what the stop reason asks for ("resume with more turns / tokens / budget"), and never less
    // than the server says one more turn needs (a smaller resume is refused: the run would stop again).
    const why = run.error || "";
    const needs = run.resume_needs || {};
    const prefill = (name, suggested, pattern) => String(Math.max(pattern.test(why) ? suggested : 0, needs[name] || 0));
    const turns = h("input", { type: "number", min: "0", step: "1", value: prefill("add_turns", 10, /max_turns/),
      id: "resume-turns", "aria-label": "add turns" });
    const tokens = h("input", { type: "number", min: "0", step: "1000",
      value: prefill("add_tokens", 100000, /max_total_tokens/), id: "resume-tokens", "aria-label": "add tokens" });
    const usd = h("input", { type: "number", min: "0", step: "any", value: prefill("add_usd", 1, /max_cost_usd/),
      id: "resume-usd", "aria-label": "add USD" });
    buttons.push(h("span", { class: "resume" },
      h("label", {}, "+ turns ", turns), h("label", {}, "+ tokens ", tokens), h("label", {}, "+ USD ", usd),
      h("button", { type: "button", class: "primary", dataset: { action: "resume" }, onclick: () => post("resume", {
        add_turns: Number(turns.value) || 0, add_tokens: Number(tokens.value) || 0, add_usd: Number(usd.value) || 0,
      }, "Resumed.") }, "Resume")));
  }
  if (!TERMINAL.has(run.status)) {
    buttons.push(h("button", { type: "button", class: "danger", dataset: { action: "cancel" }, onclick: () => {
      if (confirm("Cancel run " + run.id + " for good?")) post("cancel", {}, "Cancelled.");
    } }, "Cancel run"));
  }
  if (buttons.length) out.push(h("div", { class: "buttons" }, buttons));
  return out;
}

// Follow-up messages and forks (agentpool.conversation): built once per page, so typing survives refreshes.
function talkPanel(runId, done) {
  const text = h("textarea", { id: "message-text", rows: "2", placeholder: "A message for the run (delivered at its next turn boundary)", "aria-label": "message" });
  const atTurn = h("input", { type: "number", min: "0", step: "1", id: "fork-turn", placeholder: "latest", "aria-label": "fork at turn" });
  const feedback = h("div", { class: "feedback", id: "talk-feedback", role: "status" });
  const waiting = h("ul", { id: "inbox", class: "inbox" });
  const waitingBox = h("div", { id: "inbox-box", hidden: true }, h("h3", {}, "Waiting for delivery"), waiting);
  // One id per message typed, kept across retries of the same click: the server delivers it once.
  let pending = null;
  async function act(action, body, ok) {
    feedback.className = "feedback";
    feedback.textContent = "";
    try {
      const reply = await api("/api/runs/" + encodeURIComponent(runId) + "/" + action, { method: "POST", body });
      feedback.className = "feedback ok";
      feedback.textContent = ok(reply);
      return reply;
    } catch (err) {
      feedback.className = "feedback bad";
      feedback.textContent = err.message;
      return null;
    } finally {
      done();
    }
  }
  const send = h("button", { type: "button", class: "primary", id: "send-message", dataset: { action: "message" }, onclick: async () => {
    if (!text.value.trim()) return;
    if (!pending || pending.text !== text.value) pending = { text: text.value, id: "m_web_" + Date.now().toString(16) + Math.random().toString(16).slice(2, 10) };
    const reply = await act("message", { text: pending.text, message_id: pending.id }, (r) => "Sent (" + r.message_id + ").");
    if (reply) { text.value = ""; pending = null; }
  } }, "Send");
  // Likewise one fork id per turn asked for, kept across retries: a click again after a lost reply gets
  // the fork already made, not a second one. It keeps the parent's "-sN" ending: the fork lives on its shard.
  let pendingFork = null;
  const fork = h("button", { type: "button", id: "fork-run", dataset: { action: "fork" }, onclick: async () => {
    const turn = atTurn.value === "" ? null : Number(atTurn.value);
    if (!pendingFork || pendingFork.turn !== turn) {
      const shard = runId.match(/-s\d+$/);
      pendingFork = { turn, id: "r_web_" + Date.now().toString(16) + Math.random().toString(16).slice(2, 10) + (shard ? shard[0] : "") };
    }
    const reply = await act("fork", { at_turn: turn, fork_id: pendingFork.id }, (r) => "Forked: " + r.run_id);
    if (reply) location.href = "/runs/" + encodeURIComponent(reply.run_id);
  } }, "Fork");
  const card = h("section", { class: "card", id: "talk-card" },
    h("h2", {}, "Talk to the run"),
    h("div", { class: "talk" }, text, h("div", { class: "buttons" }, send)),
    waitingBox,
    h("div", { class: "buttons fork" }, h("label", {}, "Fork at turn ", atTurn), fork),
    feedback);
  function update(run) {
    const inbox = run.inbox || [];
    waitingBox.hidden = inbox.length === 0;
    waiting.replaceChildren(...inbox.map((m) => h("li", { dataset: { messageId: m.id } },
      h("span", { class: "mono small muted" }, m.id + " "),
      typeof m.content === "string" ? m.content : m.content.map((b) => b.text || "[" + b.type + "]").join(" "))));
  }
  return { card, update };
}

function ledgerTable(ledger) {
  const ids = Object.keys(ledger);
  if (ids.length === 0) return h("p", { class: "muted small" }, "No tool has run yet.");
  return h("table", { class: "ledger", id: "ledger-table" },
    h("thead", {}, h("tr", {}, h("th", {}, "Tool"), h("th", {}, "Effect"), h("th", { class: "num" }, "Tries"), h("th", {}, "Outcome"))),
    h("tbody", {}, ids.map((id) => {
      const e = ledger[id];
      const o = e.outcome;
      const state = !o ? h("span", { class: "badge st-waiting_approval" }, "started, no outcome")
        : o.is_error ? h("span", { class: "badge st-failed" }, o.how + " · error")
          : h("span", { class: "badge st-completed" }, o.how);
      return h("tr", { dataset: { toolUseId: id } },
        h("td", { title: id }, e.name || "?"),
        h("td", {}, h("span", { class: "effect eff-" + (e.effect || "none") }, e.effect || "—")),
        h("td", { class: "num" }, e.attempt || 0),
        h("td", {}, !o ? state : o.content === null
          ? h("span", { title: "the result is in the conversation" }, state,
            h("span", { class: "muted small" }, " " + fmtNum(o.chars) + " chars"))
          : h("details", {}, h("summary", {}, state), h("pre", { class: "result small" }, o.content))));
    })));
}

function eventItem(ev) {
  const ms = Number(ev.id.split("-")[0]);
  // A field holding a moment (a wait's end, epoch seconds) reads on the same clock as the event's time.
  const shown = (k, v) => (k === "until" && Number(v) > 0 ? new Date(Number(v) * 1000).toLocaleTimeString() : v);
  const fields = Object.entries(ev).filter(([k]) => k !== "id" && k !== "kind").map(([k, v]) => k + "=" + shown(k, v)).join("  ");
  return h("li", { class: "event" + (/error|takeover|failed/.test(ev.kind + (ev.status || "")) ? " bad" : "") },
    h("span", { class: "ev-time mono", title: new Date(ms).toLocaleString() }, new Date(ms).toLocaleTimeString()),
    h("span", { class: "ev-kind" }, ev.kind),
    h("span", { class: "ev-fields" }, fields));
}

// The model call in flight, as it streams (from /api/runs/<id>/live): one span per content block.
function liveView() {
  const title = h("span", { class: "muted small", id: "live-title" }, "waiting for the model…");
  const output = h("div", { class: "live-output", id: "live-output" });
  const card = h("section", { class: "card", id: "live-card", hidden: true },
    h("div", { class: "live-head" }, h("h2", {}, "Live"), title), output);
  let blocks = {};
  let turn = null;
  function block(entry) {
    if (!blocks[entry.index]) {
      const kind = entry.block || (entry.type === "thinking_delta" ? "thinking" : entry.type === "input_json_delta" ? "tool_use" : "text");
      const span = h("span", { class: "live-block live-" + (kind === "tool_use" ? "tool" : kind), dataset: { index: String(entry.index) } });
      if (kind === "tool_use") span.append("→ " + (entry.name || "tool") + " ");
      if (kind === "compaction") span.append("(the API is compacting the conversation)");
      blocks[entry.index] = span;
      output.append(span);
    }
    return blocks[entry.index];
  }
  function apply(entry) {
    card.hidden = false;
    if (entry.type === "call_start") {
      blocks = {};
      turn = entry.turn;
      output.replaceChildren();
      output.classList.add("live-cursor");
      title.textContent = "turn " + entry.turn + (entry.purpose === "summary" ? " · writing a summary to compact the conversation" : " · the model is writing…");
    } else if (entry.type === "block_start") {
      block(entry);
    } else if (entry.type === "text_delta" || entry.type === "thinking_delta" || entry.type === "input_json_delta") {
      block(entry).append(entry.text);
      output.scrollTop = output.scrollHeight;
    } else if (entry.type === "call_end") {
      output.classList.remove("live-cursor");
      title.textContent = "turn " + turn + (entry.outcome === "complete" ? " · done" : " · cut off (" + entry.outcome + "); it will be retried");
    }
  }
  return { card, apply };
}

// The run's turns as rows of bars on one time axis (from /api/runs/<id>/timeline), drawn in SVG.
function drawTimeline(box, doc) {
  const turns = doc.turns.filter((t) => t.start !== null).slice(-MAX_TIMELINE_TURNS);
  if (turns.length === 0) {
    box.replaceChildren(h("p", { class: "muted small" }, "No turn yet."));
    return;
  }
  const t0 = Math.min(...turns.map((t) => t.start));
  const t1 = Math.max(...turns.map((t) => t.end || t.start), t0 + 0.001);
  const width = 1000, left = 64, right = 170, rowH = 16, top = 4;
  const plot = width - left - right;
  const x = (t) => left + ((t - t0) / (t1 - t0)) * plot;
  const w = (a, b) => Math.max(1, x(b === null || b === undefined ? t1 : b) - x(a));
  const seconds = (a, b) => ((b === null || b === undefined ? t1 : b) - a).toFixed(2) + " s";
  const rows = turns.map((t, i) => {
    const y = top + i * rowH;
    const g = svg("g", { class: "tl-row", "data-turn": t.turn });
    g.append(svg("text", { x: 0, y: y + 11 }, "turn " + t.turn));
    g.append(svg("line", { class: "tl-track", x1: left, x2: left + plot, y1: y + 8, y2: y + 8 }));
    for (const wait of t.waits) {
      g.append(svg("rect", { class: "tl-wait-" + wait.kind, x: x(wait.start), y: y + 2, width: w(wait.start, wait.end), height: rowH - 4 },
        svg("title", {}, (wait.kind === "approval" ? "waiting for approval " : "backoff after " + (wait.error || "an error") + " ") + seconds(wait.start, wait.end))));
    }
    for (const call of t.model) {
      g.append(svg("rect", { class: "tl-model", x: x(call.start), y: y + 3, width: w(call.start, call.end), height: rowH - 6 },
        svg("title", {}, "model " + seconds(call.start, call.end) + (t.stop_reason ? " · " + t.stop_reason : ""))));
    }
    for (const tool of t.tools) {
      g.append(svg("rect", { class: "tl-tool" + (tool.is_error ? " tl-error" : ""), x: x(tool.start), y: y + 4, width: w(tool.start, tool.end), height: rowH - 8 },
        svg("title", {}, (tool.name || "tool") + " " + seconds(tool.start, tool.end) + (tool.is_error ? " · error" : ""))));
    }
    for (const c of t.compactions) {
      g.append(svg("rect", { class: "tl-compaction", x: x(c.at), y: y + 1, width: w(c.at, c.end || c.at), height: rowH - 2 },
        svg("title", {}, "compaction (" + (c.mode === "server" ? "by the API" : "summary call") + (c.why ? ", " + c.why : "") + ")")));
    }
    for (const k of t.takeovers) {
      g.append(svg("line", { class: "tl-takeover", x1: x(k.at), x2: x(k.at), y1: y, y2: y + rowH },
        svg("title", {}, "takeover: " + (k.cause || "?"))));
    }
    const note = fmtNum(t.tokens) + " tok · " + fmtUsd(t.cost_usd) + (t.cuts ? " · " + t.cuts + " cut" : "");
    g.append(svg("text", { x: left + plot + 8, y: y + 11 }, note));
    return g;
  });
  const height = top + turns.length * rowH + 16;
  const axis = svg("text", { x: left, y: height - 3 }, "0 s");
  const end = svg("text", { x: left + plot, y: height - 3, "text-anchor": "end" }, (t1 - t0).toFixed(1) + " s");
  const chart = svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": "timeline of the run's turns" }, ...rows, axis, end);
  const legend = h("div", { class: "legend" },
    ...[["model", "model call"], ["tool", "tool"], ["approval", "waiting for approval"], ["backoff", "backoff"],
      ["compaction", "compaction"], ["takeover", "takeover"]].map(([k, label]) => h("span", {}, h("span", { class: "swatch sw-" + k }), label)),
    doc.turns.length > turns.length ? h("span", {}, "last " + turns.length + " turns") : null,
    h("span", {}, "from the " + doc.events + " most recent events"));
  box.replaceChildren(h("div", { class: "timeline-wrap" }, chart), legend);
}

function runPage(app, runId) {
  const state = { from: 0, toolNames: {}, lastEvent: "0-0", actionsKey: null, run: null, events: 0, liveAfter: "0-0", timelineAt: 0 };
  const live = liveView();
  const timelineBox = h("div", { id: "timeline", class: "timeline" });
  const windowMarker = h("div", { class: "window-marker", id: "window-marker" },
    "compacted: the next request starts here; what is above is summarized");
  const headerInfo = h("div", { id: "run-info" });
  const actions = h("div", { id: "run-actions", class: "actions" });
  // Outside the actions panel, which is rebuilt when the status changes: the outcome of a click stays.
  const feedback = h("div", { class: "feedback", id: "action-feedback", role: "status" });
  // Why the run cannot be read now (Redis or its shard down); the header below is as last read, if ever.
  const unavailable = h("p", { class: "error-text", id: "run-unavailable", role: "status", hidden: true });
  const header = h("section", { class: "card run-header", id: "run-header" }, unavailable, headerInfo, actions, feedback);
  const conversation = h("div", { id: "conversation", class: "conversation" });
  const ledgerBox = h("div", { id: "ledger" });
  const eventList = h("ol", { id: "events", class: "events", reversed: true });
  const talk = talkPanel(runId, () => poll.kick());

  app.replaceChildren(
    h("p", { class: "crumbs" }, h("a", { href: "/" }, "← All runs")),
    header,
    talk.card,
    live.card,
    h("section", { class: "card", id: "timeline-card" }, h("h2", {}, "Timeline"), timelineBox),
    h("div", { class: "layout" },
      h("section", { class: "card main" }, h("h2", {}, "Conversation"), conversation),
      h("aside", { class: "side" },
        h("section", { class: "card" }, h("h2", {}, "Ledger"), ledgerBox),
        h("section", { class: "card" }, h("h2", {}, "Events"), h("div", { class: "events-wrap" }, eventList)))));

  async function post(action, body, done) {
    feedback.className = "feedback";
    feedback.textContent = "";
    for (const b of actions.querySelectorAll("button")) b.disabled = true;
    try {
      await api("/api/runs/" + encodeURIComponent(runId) + "/" + action, { method: "POST", body });
      feedback.className = "feedback ok";
      feedback.textContent = done;
    } catch (err) {
      feedback.className = "feedback bad";
      feedback.textContent = err.message;
    } finally {
      for (const b of actions.querySelectorAll("button")) b.disabled = false;
      state.actionsKey = null;
      poll.kick();
    }
  }

  async function refresh() {
    let doc;
    try {
      doc = await api("/api/runs/" + encodeURIComponent(runId) + "?from=" + state.from);
    } catch (err) {
      if (err.status === 404) showError(app, err);
      if (err.status === 503) {
        unavailable.textContent = "Cannot read this run: " + err.message;
        unavailable.hidden = false;
      }
      throw err;
    }
    unavailable.hidden = true;
    const run = doc.run;
    state.run = run;
    headerInfo.replaceChildren(...runHeader(run, doc.now).filter(Boolean));
    talk.update(run);
    const key = run.status + "|" + (run.pending || []).map((p) => p.id).join(",");
    if (key !== state.actionsKey) {
      actions.replaceChildren(...actionsPanel(run, post));
      state.actionsKey = key;
    }
    if (doc.messages_from === state.from) {
      doc.messages.forEach((m, i) => {
        conversation.append(renderMessage(m, state.from + i, state.toolNames));
        const first = Array.isArray(m.content) && m.content[0];
        if (m.role === "assistant" && first && first.type === "compaction" && first.content) state.compactedAt = state.from + i;
      });
      state.from = doc.message_count;
    }
    if (conversation.childElementCount === 0) conversation.append(h("p", { class: "muted" }, "No messages."));
    // Where the next request starts: the header's window, or a later compaction block the API returned.
    const windowStart = Math.max(run.window_start || 0, state.compactedAt || 0);
    const start = conversation.querySelector('article[data-index="' + windowStart + '"]');
    if (windowStart > 0 && start) conversation.insertBefore(windowMarker, start);
    ledgerBox.replaceChildren(ledgerTable(doc.ledger));

    const evs = await api("/api/runs/" + encodeURIComponent(runId) + "/events?after=" + state.lastEvent);
    for (const ev of evs.events) {
      eventList.prepend(eventItem(ev));
      state.lastEvent = ev.id;
    }
    while (eventList.childElementCount > MAX_EVENTS_SHOWN) eventList.lastElementChild.remove();
    document.title = run.status + " · " + run.id + " · agentpool";
    if ((evs.events.length && Date.now() - state.timelineAt > TIMELINE_EVERY_MS) || !state.timelineAt || TERMINAL.has(run.status)) {
      state.timelineAt = Date.now();
      drawTimeline(timelineBox, await api("/api/runs/" + encodeURIComponent(runId) + "/timeline"));
    }
    return TERMINAL.has(run.status) ? null : RUN_POLL_MS;
  }

  // A long poll: each request waits up to 2 s for output, and asking is what makes the workers publish it.
  async function follow() {
    while (!(state.run && TERMINAL.has(state.run.status))) {
      try {
        const doc = await api("/api/runs/" + encodeURIComponent(runId) + "/live?after=" + state.liveAfter);
        for (const entry of doc.entries) live.apply(entry);
        state.liveAfter = doc.last;
        if (doc.busy) await sleep(1000); // the server had no room for one more waiting poll: ask again later
      } catch (err) {
        if (err.status === 404 || err.status === 401) return;
        await sleep(2000);
      }
    }
  }

  const poll = poller(refresh);
  follow();
}

// ---------------------------------------------------------------------------------------------

async function main() {
  takeTokenFromUrl();
  const app = document.getElementById("app");
  let config;
  try {
    config = await api("/api/config");
  } catch (err) {
    showError(app, err);
    return;
  }
  renderAuth(config);
  if (config.token_required && !sessionStorage.getItem(TOKEN_KEY)) {
    app.replaceChildren(h("p", { class: "muted" }, "This dashboard needs its token to show runs."));
    askForToken("This dashboard needs a token (AGENTPOOL_DASHBOARD_TOKEN).");
    return;
  }
  const match = location.pathname.match(/^\/runs\/([A-Za-z0-9_-]+)$/);
  if (match) runPage(app, match[1]);
  else listPage(app);
}

main();
