// overnight view: every value goes into the page as text (textContent), never as markup.
"use strict";
let offset = 0;
const LIMIT = 50;
let lastTokens = null;
let outputColumn = null;  // the generated text's column: the widest
let lastBody = null;  // the page of rows shown, redrawn when the bookkeeping toggle changes
// A row's bookkeeping: shown last, and only behind the toggle (an error only where a row has one)
const BOOKKEEPING = new Set(["request_key", "finish_reason", "prompt_tokens", "completion_tokens",
  "reasoning_tokens", "error_kind", "error", "image_count", "image_tokens", "dropped_by"]);
const STEP_BOOKKEEPING = /_(finish_reason|prompt_tokens|completion_tokens|reasoning_tokens)$/;
const SHORT = 32;  // a column whose values are all this short (ids, numbers) never wraps
// `overnight view OUT`: the job's data at /api. Under `overnight serve`, /ui/batches/ID is a
// batch's job, its data behind the key the batches page (/ui) keeps in this tab.
const BATCH = (location.pathname.match(/^\/ui\/batches\/([^/]+)$/) || [])[1];
const API = BATCH ? `/v1/batches/${BATCH}/view` : "/api";

async function get(path) {
  const headers = {};
  const key = sessionStorage.getItem("overnight-key");
  if (BATCH && key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(API + path, {headers});
  if (BATCH && response.status === 401) location.href = "/ui";  // no key, or a wrong one
  return response;
}

function problem(body) {  // the view's {"error": "..."} or the API's {"error": {"message"}}
  return typeof body.error === "string" ? body.error : (body.error || {}).message || "failed";
}

function text(id, value) { document.getElementById(id).textContent = value; }

function filters() {
  const data = new FormData(document.getElementById("filters"));
  const params = new URLSearchParams();
  for (const [k, v] of data.entries()) { if (v) params.set(k, v); }
  return params;
}

async function status() {
  const response = await get("/status");
  const s = await response.json();
  if (!response.ok) {  // a batch that has not started, or is not this key's
    text("state", problem(s));
    return {state: "waiting"};
  }
  text("output", s.output);
  const batch = s.batch ? `batch ${s.batch.status} · ` : "";
  outputColumn = s.output_column || null;
  text("state", `${batch}${s.state || "?"} · model ${s.model || "?"} · ` +
    `${s.parts} part${s.parts === 1 ? "" : "s"}`);
  text("rows", `${s.rows_done.toLocaleString()} / ${s.rows_total.toLocaleString()}`);
  document.getElementById("done-bar").style.width =
    `${Math.min(100, 100 * s.rows_done / Math.max(s.rows_total, 1))}%`;
  const failed = Object.values(s.errors).reduce((a, b) => a + b, 0);
  text("error-count", failed.toLocaleString());
  const list = document.getElementById("errors");
  list.replaceChildren(...Object.entries(s.errors).map(([kind, n]) => {
    const li = document.createElement("li"); li.textContent = `${kind}: ${n}`; return li;
  }));
  const select = document.getElementById("f-error");
  for (const kind of Object.keys(s.errors)) {
    if (![...select.options].some(o => o.value === kind)) {
      const o = document.createElement("option"); o.value = kind; o.textContent = kind;
      select.appendChild(o);
    }
  }
  text("tokens", `${s.tokens.prompt.toLocaleString()} in · ${s.tokens.output.toLocaleString()} out`);
  if (lastTokens !== null && s.state === "running") {
    text("rate", `${Math.round((s.tokens.output - lastTokens) / 3)} output tok/s written`);
  } else { text("rate", ""); }
  lastTokens = s.tokens.output;
  const steps = document.getElementById("steps");
  document.getElementById("steps-card").hidden = !s.steps.length;
  steps.replaceChildren(...s.steps.map(step => {
    const li = document.createElement("li");
    li.textContent = `${step.name}: ${step.rows_in} in → ${step.rows_out} out` +
      (step.dropped ? `, ${step.dropped} dropped` : "") + (step.errors ? `, ${step.errors} errors` : "");
    return li;
  }));
  const report = document.getElementById("report");
  report.hidden = !s.report;
  if (s.report) report.textContent = s.report.join("\n");
  return s;
}

async function rows() {
  const params = filters();
  params.set("offset", offset); params.set("limit", LIMIT);
  const response = await get(`/rows?${params}`);
  const body = await response.json();
  const error = document.getElementById("rows-error");
  error.hidden = response.ok;
  if (!response.ok) { error.textContent = problem(body); return; }
  lastBody = body;
  draw(body);
  const last = Math.min(body.offset + body.rows.length, body.matching);
  text("matching", body.matching ? `rows ${body.offset + 1}–${last} of ${body.matching.toLocaleString()}` : "no rows");
}

function isBookkeeping(name) { return BOOKKEEPING.has(name) || STEP_BOOKKEEPING.test(name); }

// The columns in the order a person reads them: the row's own, the generated text, then
// bookkeeping (behind the toggle; an error column only where a row on the page has one).
function layout(body) {
  const all = document.getElementById("bookkeeping").checked;
  const index = body.columns.map((name, at) => ({name, at}));
  const filled = c => body.rows.some(row => row[c.at] !== null && row[c.at] !== "");
  const mine = index.filter(c => !isBookkeeping(c.name));
  const kept = index.filter(c => isBookkeeping(c.name) &&
    (all || ((c.name === "error" || c.name === "error_kind") && filled(c))));
  return [...mine, ...kept].map(c => {
    const values = body.rows.map(row => row[c.at] === null ? "" : String(row[c.at]));
    const short = values.every(v => v.length <= SHORT && !v.includes("\n"));
    c.kind = c.name === outputColumn ? "generated" : short ? "short" : "text";
    return c;
  });
}

function draw(body) {
  const columns = layout(body);
  const head = document.querySelector("#table thead tr");
  head.replaceChildren(...columns.map(c => {
    const th = document.createElement("th"); th.textContent = c.name; th.className = c.kind;
    return th;
  }));
  const errorAt = body.columns.indexOf("error");
  const tbody = document.querySelector("#table tbody");
  tbody.replaceChildren(...body.rows.map((row, i) => {
    const tr = document.createElement("tr");
    if (errorAt >= 0 && row[errorAt] !== null) tr.className = "failed";
    tr.dataset.offset = body.offset + i;
    for (const c of columns) {
      const td = document.createElement("td");
      const value = row[c.at];
      td.textContent = value === null ? "" : String(value);
      td.className = c.kind;
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => prompt(body.offset + i));
    return tr;
  }));
}

async function prompt(at) {
  const params = filters(); params.set("offset", at);
  const body = await (await get(`/prompt?${params}`)).json();
  document.getElementById("prompt-box").hidden = false;
  text("prompt-row", String(at + 1));
  text("prompt", body.prompt === null || body.prompt === undefined
    ? (body.error || "(no prompt: this job has no template)") : body.prompt);
}

document.addEventListener("DOMContentLoaded", async () => {
  document.getElementById("back").hidden = !BATCH;
  document.getElementById("filters").addEventListener("submit", e => {
    e.preventDefault(); offset = 0; rows();
  });
  document.getElementById("prev").addEventListener("click", () => {
    offset = Math.max(0, offset - LIMIT); rows();
  });
  document.getElementById("next").addEventListener("click", () => { offset += LIMIT; rows(); });
  document.getElementById("bookkeeping").addEventListener("change", () => {
    if (lastBody) draw(lastBody);
  });
  let s = await status();
  await rows();
  setInterval(async () => {
    const before = s.state;
    s = await status();
    if (s.state === "running" || s.state === "waiting" || before !== s.state) rows();
  }, 3000);
});
